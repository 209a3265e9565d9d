//! One draft-extend step's inputs, checked against a plan, and padded to a bucket.
//!
//! The checks are the `run` contract's value bounds; the padding is what host prep does
//! before a replay: padded requests get prefix length 0, accept length N, token 0, zero
//! hidden states and a page-table row that points only at the scratch page, so their K/V
//! writes land on a page no request owns.

use specplan_format::{BucketPlan, Plan};
pub use specplan_kernels::kv::TableMode;

use crate::admission;

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

pub fn input_error(tensor: &str, index: String, message: String) -> InputError {
    InputError {
        tensor: tensor.into(),
        index,
        message,
    }
}

impl StepInputs {
    /// Checks every value bound of the contract against `plan` and a pool of `pool_pages`
    /// caller-owned pages (the rules of [`crate::admission`]). O(b·N·H) for the hidden
    /// states' finiteness, O(b·N + b) otherwise; never touches the KV cache.
    pub fn check(&self, plan: &Plan, pool_pages: usize) -> Result<(), InputError> {
        let b = self.batch;
        let n = plan.spec.num_draft_tokens as usize;
        let h = plan.model.hidden as usize;
        let max_b = plan.buckets.last().map_or(0, |x| x.batch as usize);
        admission::check_batch(b, Some(max_b))?;
        admission::check_shape("input_ids", self.input_ids.len(), b * n, &format!("[{b}, {n}]"))?;
        admission::check_shape(
            "hidden_states",
            self.hidden_states.len(),
            b * n * h,
            &format!("[{b}, {n}, {h}]"),
        )?;
        admission::check_shape("prefix_lens", self.prefix_lens.len(), b, &format!("[{b}]"))?;
        admission::check_shape("accept_lens", self.accept_lens.len(), b, &format!("[{b}]"))?;
        if self.page_cols == 0 {
            return Err(input_error("page_table", String::new(), "has no columns".into()));
        }
        admission::check_shape(
            "page_table",
            self.page_table.len(),
            b * self.page_cols,
            &format!("[{b}, {}]", self.page_cols),
        )?;
        admission::check_ids(&self.input_ids, plan.model.vocab, n)?;
        if let Some((i, x)) = self.hidden_states.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(input_error(
                "hidden_states",
                format!("[{}][{}][{}]", i / (n * h), i / h % n, i % h),
                format!("{x} is not finite"),
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
            admission::check_page_ids("page_table", i, &row[..(l + n).div_ceil(ps)], pool_pages)?;
            adm.writes(i, l, n, ps, row)?;
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
