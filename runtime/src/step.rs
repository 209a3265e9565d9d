//! One draft-extend step's inputs, checked against a plan, and padded to a bucket.
//!
//! The checks are the `run` contract's value bounds; the padding is what host prep does
//! before a replay: padded requests get prefix length 0, accept length N, token 0, zero
//! hidden states and a page-table row that points only at the scratch page, so their K/V
//! writes land on a page no request owns.
//!
//! Who checks what, for host inputs:
//! - [`StepInputs::check`] (the library): batch size, every tensor's shape, input ids in
//!   the vocabulary, hidden states finite *after* rounding to the plan's activation type,
//!   lengths, page-table rows against the pool, no two requests writing one cache slot
//!   (the rules of [`crate::admission`]) and no request reading a slot another writes
//!   ([`crate::aliasing`]). O(b·N·H) for the hidden states, O(Σ (L + N)) for the rows (what
//!   the attention reads); it never reads the KV cache or the weights.
//! - The file contract ([`crate::contract`], `specplan run`) adds what only files carry:
//!   dtypes and shapes of every tensor, finite weights and K/V caches (after rounding to
//!   the activation type; the first bad index is named), one KV dtype equal to the plan's,
//!   the FR-Spec id map.
//! - An engine calling the GPU step API owns its weights and K/V pool: their values are
//!   not checked per step; the step's own inputs pass the rules of [`crate::admission`],
//!   and a step whose outputs come out non-finite is reported (`DeviceRule::NonFinite` in
//!   engine memory; the outputs' check of [`crate::contract`] for files).

use specplan_format::io;
use specplan_format::PhaseKind;
use specplan_format::{BucketPlan, DType, Plan};
pub use specplan_kernels::kv::TableMode;

use crate::{admission, aliasing};

/// Inputs of a step for `b` real requests (host memory, row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct StepInputs {
    pub batch: usize,
    /// `[b, N]`.
    pub input_ids: Vec<i64>,
    /// `[b, N, H]`, as f32 (the file's bf16 values, exactly).
    pub hidden_states: Vec<f32>,
    /// `[b]`.
    pub prefix_lens: Vec<i32>,
    /// `[b]`.
    pub accept_lens: Vec<i32>,
    /// `[b, page_cols]`.
    pub page_table: Vec<i32>,
    pub page_cols: usize,
}

pub use crate::admission::{input_error, InputError};

/// The first value of `v` that is not finite once rounded to the activation type `act`
/// (what the device holds), with the reason; `None` when all are finite.
pub fn first_non_finite(v: &[f32], act: DType) -> Option<(usize, String)> {
    let (max, name) = match act {
        DType::F16 => (half::f16::MAX.to_f32(), "fp16"),
        _ => (half::bf16::MAX.to_f32(), "bf16"),
    };
    // Values up to the type's largest finite value stay finite; above it, rounding may
    // still give that value (round to nearest), so the exact rounding decides.
    let bad = |x: f32| !x.is_finite() || (x.abs() > max && !crate::bits::round_act(x, act).is_finite());
    let i = v.iter().position(|&x| bad(x))?;
    let x = v[i];
    Some((
        i,
        if x.is_finite() {
            format!("{x} is not finite in {name}, the plan's activation type (|x| ≤ {max})")
        } else {
            format!("{x} is not finite")
        },
    ))
}

impl StepInputs {
    /// Checks every value bound of the contract against `plan` and a pool of `pool_pages`
    /// caller-owned pages (the rules of [`crate::admission`]), and that every hidden state
    /// is finite after rounding to the plan's activation type. O(b·N·H) for the hidden
    /// states, O(b·N + b) otherwise; never touches the KV cache or the weights (see the
    /// module docs for what the file contract checks beyond this).
    pub fn check(&self, plan: &Plan, pool_pages: usize) -> Result<(), InputError> {
        let b = self.batch;
        let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
        // The input rows' width (3·H_t for an EAGLE-3 head).
        let h = plan.model.hidden_in() as usize;
        let max_b = plan.buckets().last().map_or(0, |x| x.batch as usize);
        admission::check_batch(b, Some(max_b))?;
        admission::check_staged(plan, PhaseKind::DraftExtend, io::INPUT_IDS, self.input_ids.len(), b)?;
        admission::check_staged(
            plan,
            PhaseKind::DraftExtend,
            io::HIDDEN_STATES,
            self.hidden_states.len(),
            b,
        )?;
        admission::check_staged(plan, PhaseKind::DraftExtend, io::PREFIX_LENS, self.prefix_lens.len(), b)?;
        admission::check_staged(plan, PhaseKind::DraftExtend, io::ACCEPT_LENS, self.accept_lens.len(), b)?;
        if self.page_cols == 0 {
            return Err(input_error(io::PAGE_TABLE, String::new(), "has no columns".into()));
        }
        admission::check_shape(
            io::PAGE_TABLE,
            self.page_table.len(),
            b * self.page_cols,
            &format!("[{b}, {}]", self.page_cols),
        )?;
        admission::check_ids(&self.input_ids, plan.model.vocab, n)?;
        if let Some((i, message)) = first_non_finite(&self.hidden_states, plan.capture.dtype) {
            return Err(input_error(
                io::HIDDEN_STATES,
                format!("[{}][{}][{}]", i / (n * h), i / h % n, i % h),
                message,
            ));
        }
        let ps = plan.capture.page_size as usize;
        let mut adm = admission::Admission::new(0, b * n);
        adm.begin(b * n);
        for i in 0..b {
            admission::check_lengths(plan, i, self.prefix_lens[i], self.accept_lens[i])?;
            let l = self.prefix_lens[i] as usize;
            let row = &self.page_table[i * self.page_cols..(i + 1) * self.page_cols];
            admission::check_row_len(i, l, n, ps, row.len())?;
            admission::check_page_ids(io::PAGE_TABLE, i, &row[..(l + n).div_ceil(ps)], pool_pages)?;
            adm.writes(i, (l, n, ps), row, |_| true)?;
        }
        // Rule 8 (aliasing): O(Σ (L + N)), the rows the attention reads.
        let reqs: Vec<aliasing::Request> = (0..b)
            .map(|i| aliasing::Request {
                l: self.prefix_lens[i] as usize,
                admitted: true,
            })
            .collect();
        let cols = self.page_cols;
        let aliases = aliasing::check(&reqs, n, |i, pos| {
            let pg = *self.page_table.get(i * cols + pos / ps)?;
            (pg >= 0).then(|| pg as u64 * ps as u64 + (pos % ps) as u64)
        });
        if let Some((i, a)) = aliases.iter().enumerate().find_map(|(i, a)| a.map(|a| (i, a))) {
            let (page, off) = (a.slot / ps as u64, a.slot % ps as u64);
            let msg = if a.writer == i {
                format!(
                    "request {i} maps position {} to page {page} slot {off}, which it also writes at another position (a row may not name one cache slot twice)",
                    a.position
                )
            } else {
                format!(
                    "request {i} reads position {} at page {page} slot {off}, which request {} writes in this step (their K/V would race)",
                    a.position, a.writer
                )
            };
            return Err(input_error(io::PAGE_TABLE, format!("[{i}][{}]", a.position / ps), msg));
        }
        Ok(())
    }
}

/// A page table as the kernels read it, on the host: `[rows, cols]` row-major. The runtime's
/// own (`PageTable::new`) holds page ids, `[max_requests + 1, max_pages_per_request]`, row =
/// request slot, and its last row is the scratch slot: every entry is the scratch page. An
/// engine's may hold token slots instead (`TableMode`).
#[derive(Clone, Debug, PartialEq)]
pub struct PageTable {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<i32>,
    pub mode: TableMode,
}

impl PageTable {
    /// Every row starts pointing at the scratch page, so a slot that was never assigned
    /// can only ever touch the scratch page.
    pub fn new(plan: &Plan, scratch_page: i32) -> PageTable {
        let (rows, cols) = (
            plan.page_table_rows() as usize,
            plan.capture.max_pages_per_request as usize,
        );
        PageTable {
            rows,
            cols,
            data: vec![scratch_page; rows * cols],
            mode: TableMode::PageIds,
        }
    }

    pub fn scratch_slot(&self) -> i32 {
        self.rows as i32 - 1
    }

    /// Sets the first `pages.len()` entries of a request slot's row (at most a row's
    /// columns). A slot outside the table is an error naming it.
    pub fn set_row(&mut self, slot: usize, pages: &[i32]) -> Result<(), InputError> {
        if slot >= self.rows {
            return Err(input_error(
                io::PAGE_TABLE,
                format!("[{slot}]"),
                format!("request slot {slot} is outside the table's rows [0, {})", self.rows),
            ));
        }
        let n = pages.len().min(self.cols);
        self.data[slot * self.cols..slot * self.cols + n].copy_from_slice(&pages[..n]);
        Ok(())
    }
}

/// Input buffers of one bucket, padded: what host prep copies into the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct BucketInputs {
    pub input_ids: Vec<i64>,
    pub hidden_states: Vec<f32>,
    pub prefix_lens: Vec<i32>,
    pub accept_lens: Vec<i32>,
    /// `[B]`: the page-table row of each request; padded requests use the scratch slot.
    pub req_slots: Vec<i32>,
}

/// Pads inputs to `bucket`. `slots[i]` is request i's page-table row. O(B·N·H) for the
/// hidden states, O(B) for everything else. The values are [`StepInputs::check`]'s to
/// judge; this refuses only what it cannot pad (a batch above the bucket, tensors whose
/// lengths are not the batch's), naming the tensor.
pub fn pad_to_bucket(
    plan: &Plan,
    bucket: &BucketPlan,
    x: &StepInputs,
    slots: &[i32],
    scratch_slot: i32,
) -> Result<BucketInputs, InputError> {
    let (bb, b) = (bucket.batch as usize, x.batch);
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let h = plan.model.hidden_in() as usize;
    admission::check_batch(b, Some(bb))
        .map_err(|e| input_error(&e.tensor, e.index, e.message.replace("largest bucket", "bucket")))?;
    admission::check_staged(plan, PhaseKind::DraftExtend, io::INPUT_IDS, x.input_ids.len(), b)?;
    admission::check_staged(
        plan,
        PhaseKind::DraftExtend,
        io::HIDDEN_STATES,
        x.hidden_states.len(),
        b,
    )?;
    admission::check_staged(plan, PhaseKind::DraftExtend, io::PREFIX_LENS, x.prefix_lens.len(), b)?;
    admission::check_staged(plan, PhaseKind::DraftExtend, io::ACCEPT_LENS, x.accept_lens.len(), b)?;
    if slots.len() < b {
        return Err(input_error(
            "slots",
            String::new(),
            format!("has {} entries, one per request needs {b}", slots.len()),
        ));
    }
    let mut out = BucketInputs {
        input_ids: vec![0; bb * n],
        hidden_states: vec![0.0; bb * n * h],
        prefix_lens: vec![0; bb],
        accept_lens: vec![n as i32; bb],
        req_slots: vec![scratch_slot; bb],
    };
    out.input_ids[..b * n].copy_from_slice(&x.input_ids);
    out.hidden_states[..b * n * h].copy_from_slice(&x.hidden_states);
    out.prefix_lens[..b].copy_from_slice(&x.prefix_lens);
    out.accept_lens[..b].copy_from_slice(&x.accept_lens);
    out.req_slots[..b].copy_from_slice(&slots[..b]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finiteness_is_judged_after_the_cast() {
        // fp16's largest value is 65504; round to nearest keeps values below 65520 finite.
        assert_eq!(first_non_finite(&[1.0, 65519.0, -65519.0], DType::F16), None);
        let (i, m) = first_non_finite(&[1.0, 65520.0], DType::F16).expect("overflows fp16");
        assert_eq!(i, 1);
        assert_eq!(
            m,
            "65520 is not finite in fp16, the plan's activation type (|x| ≤ 65504)"
        );
        // The same value is finite in bf16; f32's largest rounds to bf16 infinity.
        assert_eq!(first_non_finite(&[65520.0], DType::Bf16), None);
        assert_eq!(first_non_finite(&[f32::MAX], DType::Bf16).map(|x| x.0), Some(0));
        let (i, m) = first_non_finite(&[0.0, 0.0, f32::NEG_INFINITY, f32::NAN], DType::Bf16).expect("inf");
        assert_eq!((i, m.as_str()), (2, "-inf is not finite"));
    }
}
