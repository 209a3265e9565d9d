//! One draft-extend step's inputs, checked against a plan, and padded to a bucket.
//!
//! The checks are the `run` contract's value bounds; the padding is what host prep does
//! before a replay: padded requests get prefix length 0, accept length N, token 0, zero
//! hidden states and a page-table row that points only at the scratch page, so their K/V
//! writes land on a page no request owns.

use std::collections::HashMap;

use crate::format::{BucketPlan, Plan};

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

/// A contract violation: the tensor, the index and the bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{tensor}{index}: {message}")]
pub struct InputError {
    pub tensor: String,
    /// `[i]` or `[i][j]`, or empty for the whole tensor.
    pub index: String,
    pub message: String,
}

pub(crate) fn input_error(tensor: &str, index: String, message: String) -> InputError {
    InputError {
        tensor: tensor.into(),
        index,
        message,
    }
}

impl StepInputs {
    /// Checks every value bound of the contract against `plan` and a pool of `pool_pages`
    /// caller-owned pages. O(b·N + b) work; never touches the KV cache.
    pub fn check(&self, plan: &Plan, pool_pages: usize) -> Result<(), InputError> {
        let b = self.batch;
        let n = plan.spec.num_draft_tokens as usize;
        let h = plan.model.hidden as usize;
        let max_b = plan.buckets.last().map_or(0, |x| x.batch as usize);
        if b == 0 || b > max_b {
            return Err(input_error(
                "input_ids",
                String::new(),
                format!("batch {b} is outside [1, {max_b}] (the plan's largest bucket)"),
            ));
        }
        let shape = |name: &str, len: usize, want: usize, dims: String| {
            if len == want {
                Ok(())
            } else {
                Err(input_error(
                    name,
                    String::new(),
                    format!("has {len} elements, expected {dims} = {want}"),
                ))
            }
        };
        shape("input_ids", self.input_ids.len(), b * n, format!("[{b}, {n}]"))?;
        shape(
            "hidden_states",
            self.hidden_states.len(),
            b * n * h,
            format!("[{b}, {n}, {h}]"),
        )?;
        shape("prefix_lens", self.prefix_lens.len(), b, format!("[{b}]"))?;
        shape("accept_lens", self.accept_lens.len(), b, format!("[{b}]"))?;
        if self.page_cols == 0 {
            return Err(input_error("page_table", String::new(), "has no columns".into()));
        }
        shape(
            "page_table",
            self.page_table.len(),
            b * self.page_cols,
            format!("[{b}, {}]", self.page_cols),
        )?;
        let vocab = plan.model.vocab as i64;
        for (r, &id) in self.input_ids.iter().enumerate() {
            if id < 0 || id >= vocab {
                return Err(input_error(
                    "input_ids",
                    format!("[{}][{}]", r / n, r % n),
                    format!("{id} is outside [0, {vocab})"),
                ));
            }
        }
        if let Some((i, x)) = self.hidden_states.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(input_error(
                "hidden_states",
                format!("[{}][{}][{}]", i / (n * h), i / h % n, i % h),
                format!("{x} is not finite"),
            ));
        }
        let ps = plan.capture.page_size as usize;
        // (page, slot) → request that writes it, to reject two requests writing one slot.
        let mut writers: HashMap<(i32, usize), usize> = HashMap::with_capacity(b * n);
        for i in 0..b {
            check_lengths_of(plan, i, self.prefix_lens[i], self.accept_lens[i])?;
            let l = self.prefix_lens[i] as i64;
            let used = (l as usize + n).div_ceil(ps);
            if used > self.page_cols {
                return Err(input_error(
                    "page_table",
                    format!("[{i}]"),
                    format!(
                        "has {} columns, but positions up to {} need {used} pages of {ps}",
                        self.page_cols,
                        l as usize + n - 1
                    ),
                ));
            }
            for c in 0..used {
                let page = self.page_table[i * self.page_cols + c];
                if page < 0 || page as usize >= pool_pages {
                    return Err(input_error(
                        "page_table",
                        format!("[{i}][{c}]"),
                        format!("page {page} is outside the pool [0, {pool_pages})"),
                    ));
                }
            }
            for j in 0..n {
                let pos = l as usize + j;
                let page = self.page_table[i * self.page_cols + pos / ps];
                if let Some(other) = writers.insert((page, pos % ps), i) {
                    return Err(input_error(
                        "page_table",
                        format!("[{i}][{}]", pos / ps),
                        format!("requests {other} and {i} both write page {page} slot {}", pos % ps),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Request `i`'s prefix and accept lengths against the plan: `0 ≤ L`, `L + N ≤ max
/// context`, `1 ≤ A ≤ N`. Shared by the file contract and the GPU step API.
pub(crate) fn check_lengths_of(plan: &Plan, i: usize, prefix: i32, accept: i32) -> Result<(), InputError> {
    let n = plan.spec.num_draft_tokens as i64;
    let ctx = plan.capture.max_context_len as i64;
    let l = prefix as i64;
    if l < 0 || l + n > ctx {
        return Err(input_error(
            "prefix_lens",
            format!("[{i}]"),
            format!("{l} + num_draft_tokens {n} must be in [{n}, max_context_len {ctx}]"),
        ));
    }
    if accept < 1 || accept as i64 > n {
        return Err(input_error(
            "accept_lens",
            format!("[{i}]"),
            format!("{accept} is outside [1, {n}]"),
        ));
    }
    Ok(())
}

/// The page table the kernels read: `[max_requests + 1, max_pages_per_request]`, row =
/// request slot. The last row is the scratch slot: every entry is the scratch page.
#[derive(Clone, Debug, PartialEq)]
pub struct PageTable {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<i32>,
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
        }
    }

    pub fn scratch_slot(&self) -> i32 {
        self.rows as i32 - 1
    }

    /// Sets the first `pages.len()` entries of a request slot's row.
    pub fn set_row(&mut self, slot: usize, pages: &[i32]) {
        let n = pages.len().min(self.cols);
        self.data[slot * self.cols..slot * self.cols + n].copy_from_slice(&pages[..n]);
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

/// Pads checked inputs to `bucket`. `slots[i]` is request i's page-table row. O(B·N·H)
/// for the hidden states, O(B) for everything else.
pub fn pad_to_bucket(
    plan: &Plan,
    bucket: &BucketPlan,
    x: &StepInputs,
    slots: &[i32],
    scratch_slot: i32,
) -> BucketInputs {
    let (bb, b) = (bucket.batch as usize, x.batch);
    let n = plan.spec.num_draft_tokens as usize;
    let h = plan.model.hidden as usize;
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
    out
}
