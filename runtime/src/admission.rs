//! Admission: the host-side checks a step passes before anything is staged or launched,
//! shared by the file contract (CPU and GPU) and the GPU step API. One function and one
//! message per rule; O(b·N + b) work, never proportional to the KV cache.
//!
//! Rules:
//! 1. `batch`: at least one request (and at most the largest bucket, for the contract).
//! 2. `shape`: every per-request tensor has `b` rows of its width.
//! 3. `ids`: every input id is in `[0, vocab)`.
//! 4. `lengths`: `0 ≤ L` and `L + N ≤ max_context_len`; `1 ≤ A ≤ N`.
//! 5. `slot`: each request names a request slot in `[0, max_requests)`, none twice.
//! 6. `pages`: the pages the request's positions `L .. L+N−1` fall in exist in its row
//!    (`check_row_len`) and lie in the pool's request pages (`check_page_ids`).
//! 7. `writes`: no two requests of a step write one cache slot (their K/V writes would
//!    race); checked with a stamped set sized by the step's rows, never by the pool.
//!    A batch above the largest bucket is checked whole before its first chunk runs.

use specplan_format::signature::{self, Dim};
use specplan_format::{io, PhaseKind, Plan};

/// A contract violation: the tensor, the index and the bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{tensor}{index}: {message}")]
pub struct InputError {
    pub tensor: String,
    /// `[i]` or `[i][j]`, or empty for the whole tensor.
    pub index: String,
    pub message: String,
}

pub fn input_error(tensor: &str, index: String, message: String) -> InputError {
    InputError {
        tensor: tensor.into(),
        index,
        message,
    }
}

/// Rule 2 from the phase's signature: the staged tensor `name` of a step of `b` requests
/// holds the elements its declared shape gives at `b` (rows shown as `[b, R]`, the view the
/// caller passes), or the error names it with that shape.
pub fn check_staged(plan: &Plan, kind: PhaseKind, name: &str, len: usize, b: usize) -> Result<(), InputError> {
    let Some(d) = signature::declared(kind).iter().find(|d| d.name == name) else {
        return Err(input_error(
            name,
            String::new(),
            format!("is not an input of the {} phase", kind.name()),
        ));
    };
    // The common case allocates nothing: the element count alone.
    let (facts, rows) = (signature::Facts::of(plan), kind.rows_per_request(&plan.spec));
    let dim = |x: Dim| facts.dim(kind, b as u32, x);
    let want = d.shape.iter().map(|&x| dim(x)).product::<u64>() as usize;
    if len == want {
        return Ok(());
    }
    let mut dims = Vec::new();
    for &x in d.shape {
        match x {
            Dim::Rows => {
                dims.push(b as u64);
                dims.push(rows as u64);
            }
            _ => dims.push(dim(x)),
        }
    }
    let text: Vec<String> = dims.iter().map(u64::to_string).collect();
    check_shape(name, len, want, &format!("[{}]", text.join(", ")))
}

/// Rule 1.
pub fn check_batch(b: usize, max_b: Option<usize>) -> Result<(), InputError> {
    match max_b {
        _ if b == 0 => Err(input_error(
            io::INPUT_IDS,
            String::new(),
            "a step needs at least one request".into(),
        )),
        Some(max) if b > max => Err(input_error(
            io::INPUT_IDS,
            String::new(),
            format!("batch {b} is outside [1, {max}] (the plan's largest bucket)"),
        )),
        _ => Ok(()),
    }
}

/// Rule 2: `len` values of `tensor`, expected `want` (`dims` is the shape, for the message).
pub fn check_shape(tensor: &str, len: usize, want: usize, dims: &str) -> Result<(), InputError> {
    if len == want {
        Ok(())
    } else {
        Err(input_error(
            tensor,
            String::new(),
            format!("has {len} elements, expected {dims} = {want}"),
        ))
    }
}

/// Rule 3.
pub fn check_ids(ids: &[i64], vocab: u32, n: usize) -> Result<(), InputError> {
    match ids.iter().position(|&x| x < 0 || x >= vocab as i64) {
        None => Ok(()),
        Some(r) => Err(input_error(
            io::INPUT_IDS,
            format!("[{}][{}]", r / n.max(1), r % n.max(1)),
            format!("{} is outside [0, {vocab})", ids[r]),
        )),
    }
}

/// Rule 4 for request `i`.
pub fn check_lengths(plan: &Plan, i: usize, prefix: i32, accept: i32) -> Result<(), InputError> {
    check_prefix(plan, PhaseKind::DraftExtend, i, prefix)?;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as i64;
    if accept < 1 || accept as i64 > n {
        return Err(input_error(
            io::ACCEPT_LENS,
            format!("[{i}]"),
            format!("{accept} is outside [1, {n}]"),
        ));
    }
    Ok(())
}

/// Rule 4's prefix part for request `i` of phase `kind`: draft-extend's N rows after the
/// prefix, or draft decode's lanes (their runs past the prefix up to forward S − 2,
/// `facts::decode_reach`), within `max_context_len`.
pub fn check_prefix(plan: &Plan, kind: PhaseKind, i: usize, prefix: i32) -> Result<(), InputError> {
    let ctx = plan.capture.max_context_len as i64;
    let l = prefix as i64;
    let (reach, what) = match kind {
        PhaseKind::DraftExtend => (plan.rows_per_request(kind) as i64, "num_draft_tokens".to_string()),
        PhaseKind::DraftDecode { steps } => {
            let r =
                specplan_kernels::facts::decode_reach(l.max(0) as u64, steps, plan.spec.topk, plan.capture.page_size);
            (r as i64, format!("the {} lanes' reach", plan.spec.topk))
        }
    };
    if l < 0 || l + reach > ctx {
        return Err(input_error(
            io::PREFIX_LENS,
            format!("[{i}]"),
            format!("{l} + {what} {reach} must be in [{reach}, max_context_len {ctx}]"),
        ));
    }
    Ok(())
}

/// Rule 6, length part, for request `i` with prefix `l`: its row holds `have` pages, and
/// positions `l .. l+N−1` must fall in them. O(1).
pub fn check_row_len(i: usize, l: usize, n: usize, page_size: usize, have: usize) -> Result<(), InputError> {
    let used = (l + n).div_ceil(page_size);
    if used > have {
        return Err(input_error(
            io::PAGE_TABLE,
            format!("[{i}]"),
            format!(
                "has {have} pages, but positions up to {} need {used} pages of {page_size}",
                l + n - 1
            ),
        ));
    }
    Ok(())
}

/// Rule 6, pool part: every page of `pages` (row `i`'s, or a slot's being assigned) lies in
/// the pool's request pages `[0, pool_pages)`. O(pages): the GPU runtime checks a slot's
/// pages once, when they are assigned, not per step.
pub fn check_page_ids(tensor: &str, i: usize, pages: &[i32], pool_pages: usize) -> Result<(), InputError> {
    match pages.iter().position(|&p| p < 0 || p as usize >= pool_pages) {
        None => Ok(()),
        Some(c) => Err(input_error(
            tensor,
            format!("[{i}][{c}]"),
            format!(
                "page {} is outside the pool's request pages [0, {pool_pages})",
                pages[c]
            ),
        )),
    }
}

/// Stamped sets for rules 5 and 7: no allocation and no clearing per step.
pub struct Admission {
    slot_seen: Vec<u32>,
    write_seen: Vec<(u64, u32)>,
    stamp: u32,
}

impl Admission {
    /// Sets for `slots` request slots and steps of up to `max_rows` rows (they grow on demand).
    pub fn new(slots: usize, max_rows: usize) -> Admission {
        Admission {
            slot_seen: vec![0; slots],
            write_seen: vec![(0, 0); write_set_capacity(max_rows)],
            stamp: 0,
        }
    }

    /// Starts a step of `rows` rows.
    pub fn begin(&mut self, rows: usize) {
        let need = write_set_capacity(rows);
        if self.write_seen.len() < need {
            self.write_seen = vec![(0, 0); need];
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.slot_seen.iter_mut().for_each(|x| *x = 0);
            self.write_seen.iter_mut().for_each(|x| *x = (0, 0));
            self.stamp = 1;
        }
    }

    /// Rule 5 for request `i`.
    pub fn slot(&mut self, i: usize, slot: i32, max_requests: u32) -> Result<(), InputError> {
        if slot < 0 || slot as u32 >= max_requests || slot as usize >= self.slot_seen.len() {
            return Err(input_error(
                io::REQ_SLOTS,
                format!("[{i}]"),
                format!("{slot} is outside [0, {max_requests})"),
            ));
        }
        if std::mem::replace(&mut self.slot_seen[slot as usize], self.stamp) == self.stamp {
            return Err(input_error(
                io::REQ_SLOTS,
                format!("[{i}]"),
                format!("slot {slot} appears twice in one step"),
            ));
        }
        Ok(())
    }

    /// Rule 7 for request `i` with prefix `l`: `row` is its page-table row. Only the pages
    /// for which `shared` holds enter the write set: a caller that knows a page is listed by
    /// no other row (and by its own once) knows no other request can write it.
    pub fn writes(
        &mut self,
        i: usize,
        (l, n, page_size): (usize, usize, usize),
        row: &[i32],
        shared: impl Fn(i32) -> bool,
    ) -> Result<(), InputError> {
        for pos in l..l + n {
            let Some(&page) = row.get(pos / page_size) else {
                return Err(input_error(
                    io::PAGE_TABLE,
                    format!("[{i}]"),
                    format!("has no page for position {pos}"),
                ));
            };
            if !shared(page) {
                continue;
            }
            let key = (page as i64 as u64)
                .wrapping_mul(page_size as u64)
                .wrapping_add((pos % page_size) as u64);
            if !insert_write(&mut self.write_seen, self.stamp, key) {
                return Err(input_error(
                    io::PAGE_TABLE,
                    format!("[{i}][{}]", pos / page_size),
                    format!(
                        "request {i} writes page {page} slot {}, which another request of this step also writes",
                        pos % page_size
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Slots of the write set: a power of two at least 4× the rows a step can have.
fn write_set_capacity(max_rows: usize) -> usize {
    (4 * max_rows.max(16)).next_power_of_two()
}

/// Inserts `key` into the stamped open-addressing set (linear probing; entries with an
/// older stamp are free). Returns false when the key is already there for this stamp.
/// The set holds at most a quarter of its slots per step, so probing always ends.
fn insert_write(set: &mut [(u64, u32)], stamp: u32, key: u64) -> bool {
    let mask = set.len() - 1;
    let mut at = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask;
    loop {
        let e = &mut set[at];
        if e.1 != stamp {
            *e = (key, stamp);
            return true;
        }
        if e.0 == key {
            return false;
        }
        at = (at + 1) & mask;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_set_finds_duplicates_within_a_step_only() {
        let cap = write_set_capacity(64 * 16);
        assert!(cap.is_power_of_two() && cap >= 4 * 64 * 16);
        let mut set = vec![(0u64, 0u32); cap];
        // Keys that collide in the low bits probe past each other.
        let keys: Vec<u64> = (0..1024u64).map(|i| i * cap as u64).collect();
        for &k in &keys {
            assert!(insert_write(&mut set, 1, k), "first insert of {k}");
        }
        for &k in &keys {
            assert!(!insert_write(&mut set, 1, k), "second insert of {k} in one step");
        }
        for &k in &keys {
            assert!(insert_write(&mut set, 2, k), "{k} in the next step");
        }
        assert!(!insert_write(&mut set, 2, keys[17]));
    }

    #[test]
    fn batch_rule() {
        assert!(check_batch(1, Some(8)).is_ok());
        assert!(check_batch(9, None).is_ok());
        assert_eq!(check_batch(0, None).unwrap_err().tensor, io::INPUT_IDS);
        let e = check_batch(9, Some(8)).unwrap_err();
        assert!(e.message.contains("batch 9 is outside [1, 8]"), "{e}");
    }

    #[test]
    fn shape_rule_names_the_tensor_and_shape() {
        assert!(check_shape(io::HIDDEN_STATES, 12, 12, "[1, 3, 4]").is_ok());
        let e = check_shape(io::HIDDEN_STATES, 11, 12, "[1, 3, 4]").unwrap_err();
        assert_eq!(e.to_string(), "hidden_states: has 11 elements, expected [1, 3, 4] = 12");
    }

    #[test]
    fn ids_rule_names_request_and_row() {
        assert!(check_ids(&[0, 9, 3, 4], 10, 2).is_ok());
        let e = check_ids(&[0, 9, 3, 10], 10, 2).unwrap_err();
        assert_eq!(e.to_string(), "input_ids[1][1]: 10 is outside [0, 10)");
        assert!(check_ids(&[-1], 10, 1).is_err());
    }

    #[test]
    fn pages_rule_bounds_row_and_pool() {
        // L = 5, N = 4 on pages of 4 tokens: positions 5..8 need pages 0..=2.
        assert!(check_row_len(0, 5, 4, 4, 3).is_ok());
        let e = check_row_len(0, 5, 4, 4, 2).unwrap_err();
        assert!(e.message.contains("need 3 pages"), "{e}");
        assert!(check_page_ids(io::PAGE_TABLE, 2, &[3, 1, 0], 4).is_ok());
        let e = check_page_ids(io::PAGE_TABLE, 2, &[3, 4, 0], 4).unwrap_err();
        assert_eq!(e.index, "[2][1]");
        assert!(check_page_ids(io::PAGE_TABLE, 0, &[-1], 4).is_err());
    }

    #[test]
    fn slot_rule_range_and_duplicates_per_step() {
        let mut a = Admission::new(4, 8);
        a.begin(8);
        assert!(a.slot(0, 2, 4).is_ok());
        assert!(a.slot(1, 4, 4).is_err());
        assert!(a.slot(1, -1, 4).is_err());
        let e = a.slot(2, 2, 4).unwrap_err();
        assert!(e.message.contains("appears twice"), "{e}");
        a.begin(8);
        assert!(a.slot(0, 2, 4).is_ok(), "a new step forgets the old slots");
    }

    fn all(_: i32) -> bool {
        true
    }

    #[test]
    fn writes_rule_catches_shared_cache_slots_only() {
        let mut a = Admission::new(4, 8);
        a.begin(8);
        // Request 0: positions 0..3 on page 7; request 1: positions 4..7 on page 7 too.
        assert!(a.writes(0, (0, 4, 8), &[7], all).is_ok());
        assert!(a.writes(1, (4, 4, 8), &[7], all).is_ok(), "disjoint slots of one page");
        let e = a.writes(2, (2, 4, 8), &[7], all).unwrap_err();
        assert!(e.message.contains("another request"), "{e}");
        a.begin(8);
        assert!(
            a.writes(2, (2, 4, 8), &[7], all).is_ok(),
            "a new step forgets the old writes"
        );
        // Growing past the initial capacity.
        a.begin(1000);
        for i in 0..100 {
            assert!(a.writes(i, (0, 8, 8), &[i as i32], all).is_ok());
        }
        // Pages the caller says no other row lists stay out of the set (and a short row is
        // still refused).
        a.begin(8);
        let only_own = |p: i32| p != 7; // page 7: listed by no other row
        assert!(a.writes(0, (0, 4, 8), &[7], only_own).is_ok());
        assert!(a.writes(1, (0, 4, 8), &[7], only_own).is_ok(), "not entered");
        assert!(a.writes(2, (0, 4, 8), &[7], all).is_ok(), "the set is still empty");
        assert!(
            a.writes(3, (0, 4, 8), &[7], all).is_err(),
            "request 2's writes are in it"
        );
        assert!(
            a.writes(4, (6, 4, 8), &[7], only_own).is_err(),
            "position 8 has no page"
        );
    }
}
