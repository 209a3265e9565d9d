//! tree.cu: draft decode's top-K tree (SGLang 0.5.23's `select_top_k_tokens` and
//! `organize_draft_results`) and the row gather that hands each lane its parent's hidden.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{BucketFacts, KernelFacts};
use crate::io;
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `tree_init`: the root's K children from draft-extend's top-K: lane k's score and token,
/// its source row (the request's hidden), the first block of the score and token lists and
/// `parent_list[0..=K] = [−1, 0, …, K−1]`.
#[derive(KernelParams)]
#[repr(C)]
pub struct TreeInitParams {
    #[arg(input = io::TOPK_PROBS)]
    pub topk_probs: DevPtr<f32>,
    #[arg(input = io::TOPK_IDS)]
    pub topk_ids: DevPtr<i64>,
    #[arg(buffer)]
    pub scores: DevPtrMut<f32>,
    #[arg(buffer)]
    pub ids: DevPtrMut<i64>,
    /// Each lane's hidden row (the request's), for step 0's gather: with one lane too, so
    /// the residual stream starts in the arena (EAGLE-3 feeds the hidden row itself as the
    /// residual, which a GEMM may not accumulate into in place while it is a staged input).
    #[arg(buffer)]
    pub src: DevPtrMut<i32>,
    #[arg(buffer)]
    pub score_list: DevPtrMut<f32>,
    #[arg(buffer)]
    pub token_list: DevPtrMut<i64>,
    #[arg(buffer)]
    pub parent_list: DevPtrMut<i64>,
    pub batch: u32,
}

/// `tree_select` (STEP = i in [1, S−1], after forward i − 1): the K² path scores of each
/// request's lanes × their top-K, their block of the lists, the K best as the next lanes
/// (scores, tokens, parent rows) and, below the last step, their parents' score indices.
#[derive(KernelParams)]
#[repr(C)]
pub struct TreeSelectParams {
    #[arg(buffer)]
    pub scores: DevPtr<f32>,
    #[arg(buffer)]
    pub probs: DevPtr<f32>,
    #[arg(buffer)]
    pub ids: DevPtr<i64>,
    /// Null at the last step (nothing reads them).
    #[arg(buffer)]
    pub scores_out: DevPtrMut<f32>,
    #[arg(buffer)]
    pub next_ids: DevPtrMut<i64>,
    /// Null at the last step and with one lane.
    #[arg(buffer)]
    pub src: DevPtrMut<i32>,
    #[arg(buffer, rw)]
    pub score_list: DevPtrMut<f32>,
    #[arg(buffer, rw)]
    pub token_list: DevPtrMut<i64>,
    /// Null at the last step (its parents are dropped).
    #[arg(buffer, rw)]
    pub parent_list: DevPtrMut<i64>,
    pub batch: u32,
}

/// `tree_finish`: the N − 1 best score indices (value descending, ties to the lower
/// index), ascending, and their tokens.
#[derive(KernelParams)]
#[repr(C)]
pub struct TreeFinishParams {
    #[arg(buffer)]
    pub score_list: DevPtr<f32>,
    #[arg(buffer)]
    pub token_list: DevPtr<i64>,
    #[arg(buffer)]
    pub top_scores_index: DevPtrMut<i64>,
    #[arg(buffer)]
    pub draft_tokens: DevPtrMut<i64>,
    pub batch: u32,
}

/// `gather_rows`: `out[z] = x[src[z]]` over the bucket's lanes; `x` has one row per request
/// at STEP 0 (the draft-extend hidden row), one per lane after.
#[derive(KernelParams)]
#[repr(C)]
pub struct GatherRowsParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    #[arg(buffer)]
    pub src: DevPtr<i32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
    pub src_rows: u32,
}

/// `tree_verify` (with `capture.decode_verify`): what SGLang's `build_tree_kernel_efficient`
/// builds for the target's verify from the tree: node 0 the bonus root at position L, node
/// j ≥ 1 the score index `top_scores_index[j − 1]` with its token; each node's parent (the
/// root for a root child, else the node whose score index is `parent_list[s / K]`; a node
/// whose parent is not chosen, possible only at exact ties or NaN, hangs from the root), its
/// position L + depth, its row r·N + j, first child and next sibling (ascending node order),
/// and the QLEN_ONLY mask (row j attends itself and its ancestors).
#[derive(KernelParams)]
#[repr(C)]
pub struct TreeVerifyParams {
    #[arg(buffer)]
    pub parent_list: DevPtr<i64>,
    #[arg(buffer)]
    pub top_scores_index: DevPtr<i64>,
    #[arg(buffer)]
    pub draft_tokens: DevPtr<i64>,
    #[arg(input = io::BONUS_TOKENS)]
    pub bonus_tokens: DevPtr<i64>,
    #[arg(input = io::PREFIX_LENS)]
    pub prefix_lens: DevPtr<i32>,
    #[arg(buffer)]
    pub tokens: DevPtrMut<i64>,
    #[arg(buffer)]
    pub positions: DevPtrMut<i64>,
    #[arg(buffer)]
    pub retrieve_index: DevPtrMut<i64>,
    #[arg(buffer)]
    pub next_token: DevPtrMut<i64>,
    #[arg(buffer)]
    pub next_sibling: DevPtrMut<i64>,
    #[arg(buffer)]
    pub mask: DevPtrMut<i32>,
    pub batch: u32,
}

pub const TREE_THREADS: u32 = 256;

impl Kernel for TreeInitParams {
    const ENTRY: Entry = Entry::TreeInit;
    fn threads(_: &KernelFacts) -> u32 {
        TREE_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], TreeInitScalars) {
        ([b.batch, 1, 1], TreeInitScalars { batch: b.batch })
    }
    fn extents(s: &TreeInitScalars, f: &KernelFacts) -> TreeInitPtrs<Extent> {
        let (b, k) = (s.batch as u64, f.topk as u64);
        TreeInitPtrs {
            topk_probs: Extent::Elems(b * k),
            topk_ids: Extent::Elems(b * k),
            scores: Extent::Elems(b * k),
            ids: Extent::Elems(b * k),
            src: Extent::Elems(b * k),
            score_list: Extent::Elems(b * f.tree_candidates() as u64),
            token_list: Extent::Elems(b * f.tree_candidates() as u64),
            parent_list: Extent::Elems(b * f.parent_width() as u64),
        }
    }
}

impl Kernel for TreeSelectParams {
    const ENTRY: Entry = Entry::TreeSelect;
    fn threads(_: &KernelFacts) -> u32 {
        TREE_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], TreeSelectScalars) {
        ([b.batch, 1, 1], TreeSelectScalars { batch: b.batch })
    }
    fn extents(s: &TreeSelectScalars, f: &KernelFacts) -> TreeSelectPtrs<Extent> {
        let (b, k) = (s.batch as u64, f.topk as u64);
        let last = f.step + 1 >= f.lanes;
        let unless = |dead: bool, n: u64| if dead { Extent::Unused } else { Extent::Elems(n) };
        TreeSelectPtrs {
            scores: Extent::Elems(b * k),
            probs: Extent::Elems(b * k * k),
            ids: Extent::Elems(b * k * k),
            scores_out: unless(last, b * k),
            next_ids: unless(last, b * k),
            src: unless(last || k == 1, b * k),
            score_list: Extent::Elems(b * f.tree_candidates() as u64),
            token_list: Extent::Elems(b * f.tree_candidates() as u64),
            parent_list: unless(last, b * f.parent_width() as u64),
        }
    }
}

impl Kernel for TreeFinishParams {
    const ENTRY: Entry = Entry::TreeFinish;
    fn threads(_: &KernelFacts) -> u32 {
        TREE_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], TreeFinishScalars) {
        ([b.batch, 1, 1], TreeFinishScalars { batch: b.batch })
    }
    fn extents(s: &TreeFinishScalars, f: &KernelFacts) -> TreeFinishPtrs<Extent> {
        let b = s.batch as u64;
        let nodes = f.draft_tokens.saturating_sub(1) as u64;
        TreeFinishPtrs {
            score_list: Extent::Elems(b * f.tree_candidates() as u64),
            token_list: Extent::Elems(b * f.tree_candidates() as u64),
            top_scores_index: Extent::Elems(b * nodes),
            draft_tokens: Extent::Elems(b * nodes),
        }
    }
}

impl Kernel for TreeVerifyParams {
    const ENTRY: Entry = Entry::TreeVerify;
    fn threads(_: &KernelFacts) -> u32 {
        TREE_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], TreeVerifyScalars) {
        ([b.batch, 1, 1], TreeVerifyScalars { batch: b.batch })
    }
    fn extents(s: &TreeVerifyScalars, f: &KernelFacts) -> TreeVerifyPtrs<Extent> {
        let b = s.batch as u64;
        let n = f.draft_tokens as u64;
        let nodes = n.saturating_sub(1);
        TreeVerifyPtrs {
            parent_list: Extent::Elems(b * f.parent_width() as u64),
            top_scores_index: Extent::Elems(b * nodes),
            draft_tokens: Extent::Elems(b * nodes),
            bonus_tokens: Extent::Elems(b),
            prefix_lens: Extent::Elems(b),
            tokens: Extent::Elems(b * n),
            positions: Extent::Elems(b * n),
            retrieve_index: Extent::Elems(b * n),
            next_token: Extent::Elems(b * n),
            next_sibling: Extent::Elems(b * n),
            mask: Extent::Elems(b * n * n),
        }
    }
}

impl Kernel for GatherRowsParams {
    const ENTRY: Entry = Entry::GatherRows;
    fn threads(_: &KernelFacts) -> u32 {
        TREE_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], GatherRowsScalars) {
        let src_rows = if f.step == 0 { b.batch } else { b.rows };
        ([b.rows, 1, 1], GatherRowsScalars { rows: b.rows, src_rows })
    }
    fn extents(s: &GatherRowsScalars, f: &KernelFacts) -> GatherRowsPtrs<Extent> {
        let h = f.hidden as u64;
        GatherRowsPtrs {
            x: Extent::Elems(s.src_rows as u64 * h),
            src: Extent::Elems(s.rows as u64),
            out: Extent::Elems(s.rows as u64 * h),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        u("HIDDEN", f.hidden),
        u("TOPK", f.topk),
        u("LANE_STEPS", f.lanes),
        u("DRAFT_TOKENS", f.draft_tokens),
        u("STEP", f.step),
    ]
}
