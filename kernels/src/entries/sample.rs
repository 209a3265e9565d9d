//! sample.cu: softmax and top-K of the logits rows, in one CTA per row or split across
//! CTAs (per-chunk records, then a merge that refines the winners) for long rows: the merge
//! as its own launch (`topk_merge`), or in the last of the row's CTAs to finish
//! (`topk_fused`).

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel, Stream};
use crate::facts::{topk_record_floats, BucketFacts, KernelFacts};
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, stream, u};

/// `softmax_topk`: one CTA per row.
#[derive(KernelParams)]
#[repr(C)]
pub struct SoftmaxTopkParams {
    #[arg(buffer)]
    pub logits: DevPtr<f32>,
    /// FR-Spec hot → full id map, EAGLE-3's d2t offsets, or null.
    #[arg(weight)]
    pub hot_ids: DevPtr<i64>,
    #[arg(buffer)]
    pub probs: DevPtrMut<f32>,
    #[arg(buffer)]
    pub ids: DevPtrMut<i64>,
    /// The refinement (`KernelFacts::refines_topk`): the selected rows of the fp32 stream
    /// `[batch, H]`, else null.
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    /// EAGLE-3's final norm weight `[H]` under the refinement, else null.
    #[arg(weight)]
    pub norm_w: DevPtr<Act>,
    /// The lm_head weight `[COLS, H]` the logits came from, under the refinement, else null.
    #[arg(weight)]
    pub lm_w: DevPtr<Act>,
    pub batch: u32,
}

/// `topk_partial`: per-chunk max, sum and top-K candidates of each row.
#[derive(KernelParams)]
#[repr(C)]
pub struct TopkPartialParams {
    #[arg(buffer)]
    pub logits: DevPtr<f32>,
    #[arg(buffer)]
    pub part: DevPtrMut<f32>,
    pub batch: u32,
    pub chunks: u32,
}

/// `topk_merge`: the row's probabilities and ids from its chunk records.
#[derive(KernelParams)]
#[repr(C)]
pub struct TopkMergeParams {
    #[arg(buffer)]
    pub part: DevPtr<f32>,
    /// FR-Spec hot → full id map, or null.
    #[arg(weight)]
    pub hot_ids: DevPtr<i64>,
    #[arg(buffer)]
    pub probs: DevPtrMut<f32>,
    #[arg(buffer)]
    pub ids: DevPtrMut<i64>,
    /// As softmax_topk's: the merged winners are refined.
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(weight)]
    pub norm_w: DevPtr<Act>,
    #[arg(weight)]
    pub lm_w: DevPtr<Act>,
    pub batch: u32,
    pub chunks: u32,
}

/// `topk_fused`: `topk_partial`'s records, then the row's merge (`topk_merge`'s) in whichever
/// of the row's CTAs finishes last, found by a per-row arrival counter. An unsharded row
/// only: a sharded plan's records meet after its all-gather.
#[derive(KernelParams)]
#[repr(C)]
pub struct TopkFusedParams {
    #[arg(buffer)]
    pub logits: DevPtr<f32>,
    /// The chunk records: written by each CTA, read back by the row's last.
    #[arg(buffer, local)]
    pub part: DevPtrMut<f32>,
    #[arg(weight)]
    pub hot_ids: DevPtr<i64>,
    #[arg(buffer)]
    pub probs: DevPtrMut<f32>,
    #[arg(buffer)]
    pub ids: DevPtrMut<i64>,
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(weight)]
    pub norm_w: DevPtr<Act>,
    #[arg(weight)]
    pub lm_w: DevPtr<Act>,
    /// One arrival counter a row (u32, zero before and after the launch).
    #[arg(counters, rw)]
    pub counters: DevPtrMut<i32>,
    pub batch: u32,
    pub chunks: u32,
}

/// `logits_gather`: a sharded plan's logits rows from every rank's gathered share
/// (rank-major `[RANKS, batch, COLS]`) into `[batch, RANKS·COLS]`.
#[derive(KernelParams)]
#[repr(C)]
pub struct LogitsGatherParams {
    #[arg(buffer)]
    pub part: DevPtr<f32>,
    #[arg(buffer)]
    pub out: DevPtrMut<f32>,
    pub batch: u32,
}

pub const LOGITS_GATHER_THREADS: u32 = 256;

impl Kernel for LogitsGatherParams {
    const ENTRY: Entry = Entry::LogitsGather;
    fn threads(_: &KernelFacts) -> u32 {
        LOGITS_GATHER_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], LogitsGatherScalars) {
        (
            [f.head_rows(b), f.tp_size.max(1), 1],
            LogitsGatherScalars { batch: f.head_rows(b) },
        )
    }
    fn extents(s: &LogitsGatherScalars, f: &KernelFacts) -> LogitsGatherPtrs<Extent> {
        let n = s.batch as u64 * f.logits_cols() as u64;
        LogitsGatherPtrs {
            part: Extent::Elems(n),
            out: Extent::Elems(n),
        }
    }
}

pub const TOPK_THREADS: u32 = 512;
/// `topk_merge`: one CTA per row; the CTA stages the row's records, warp 0 merges them (lane
/// l owns record l), every warp refines the winners (REFINE: CANDS lm_head rows read by the
/// whole CTA). 512 threads, as `softmax_topk`: at H ≤ 4096 a thread's share of the refinement
/// is one 8-element vector of each row (the 16-byte vector path), so at small CANDS its loads
/// are in flight together (at 256 the second vector's loads waited for the first's sums: one
/// more DRAM latency); at large CANDS the 128-register bound makes ptxas batch them.
pub const TOPK_MERGE_THREADS: u32 = 512;

/// Shared memory of the per-row and per-chunk kernels: a candidate list per thread.
fn topk_smem(f: &KernelFacts) -> u64 {
    TOPK_THREADS as u64 * f.topk_cands() as u64 * 8
}

/// The refinement's arguments over `b` rows: (x, norm_w, lm_w).
fn refine(f: &KernelFacts, b: u64) -> (Extent, Extent, Extent) {
    if !f.refines_topk() {
        return (Extent::Unused, Extent::Unused, Extent::Unused);
    }
    let h = f.hidden as u64;
    let norm = if f.head_norm { Extent::Elems(h) } else { Extent::Unused };
    (Extent::Elems(b * h), norm, Extent::Elems(f.cols as u64 * h))
}

/// The id map covers the full row's columns (every rank's share).
fn hot(f: &KernelFacts) -> Extent {
    if f.hot_map || f.id_offset {
        Extent::Elems(f.cols as u64 * f.tp_size.max(1) as u64)
    } else {
        Extent::Unused
    }
}

impl Kernel for SoftmaxTopkParams {
    const ENTRY: Entry = Entry::SoftmaxTopk;
    fn threads(_: &KernelFacts) -> u32 {
        TOPK_THREADS
    }
    fn smem(f: &KernelFacts) -> u64 {
        topk_smem(f)
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], SoftmaxTopkScalars) {
        ([f.head_rows(b), 1, 1], SoftmaxTopkScalars { batch: f.head_rows(b) })
    }
    fn extents(s: &SoftmaxTopkScalars, f: &KernelFacts) -> SoftmaxTopkPtrs<Extent> {
        let (b, k) = (s.batch as u64, f.topk as u64);
        let (x, norm_w, lm_w) = refine(f, b);
        SoftmaxTopkPtrs {
            logits: Extent::Elems(b * f.cols as u64),
            hot_ids: hot(f),
            probs: Extent::Elems(b * k),
            ids: Extent::Elems(b * k),
            x,
            norm_w,
            lm_w,
        }
    }
}

impl Kernel for TopkPartialParams {
    const ENTRY: Entry = Entry::TopkPartial;
    fn threads(_: &KernelFacts) -> u32 {
        TOPK_THREADS
    }
    fn smem(f: &KernelFacts) -> u64 {
        topk_smem(f)
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], TopkPartialScalars) {
        let chunks = f.topk_chunks_for(f.head_rows(b));
        (
            [f.head_rows(b), chunks, 1],
            TopkPartialScalars {
                batch: f.head_rows(b),
                chunks,
            },
        )
    }
    fn extents(s: &TopkPartialScalars, f: &KernelFacts) -> TopkPartialPtrs<Extent> {
        let b = s.batch as u64;
        TopkPartialPtrs {
            logits: Extent::Elems(b * f.cols as u64),
            part: Extent::Elems(b * s.chunks as u64 * topk_record_floats(f.topk_cands()) as u64),
        }
    }
}

impl Kernel for TopkMergeParams {
    const ENTRY: Entry = Entry::TopkMerge;
    fn threads(_: &KernelFacts) -> u32 {
        TOPK_MERGE_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], TopkMergeScalars) {
        (
            [f.head_rows(b), 1, 1],
            TopkMergeScalars {
                batch: f.head_rows(b),
                chunks: f.topk_chunks_for(f.head_rows(b)),
            },
        )
    }
    fn extents(s: &TopkMergeScalars, f: &KernelFacts) -> TopkMergePtrs<Extent> {
        let (b, k) = (s.batch as u64, f.topk as u64);
        let ranks = f.tp_size.max(1) as u64;
        let (x, norm_w, lm_w) = refine(f, b);
        TopkMergePtrs {
            part: Extent::Elems(ranks * b * s.chunks as u64 * topk_record_floats(f.topk_cands()) as u64),
            hot_ids: hot(f),
            probs: Extent::Elems(b * k),
            ids: Extent::Elems(b * k),
            x,
            norm_w,
            lm_w,
        }
    }
}

impl Kernel for TopkFusedParams {
    const ENTRY: Entry = Entry::TopkFused;
    fn threads(_: &KernelFacts) -> u32 {
        TOPK_THREADS
    }
    fn smem(f: &KernelFacts) -> u64 {
        topk_smem(f)
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], TopkFusedScalars) {
        let (grid, s) = TopkPartialParams::launch(b, f);
        (
            grid,
            TopkFusedScalars {
                batch: s.batch,
                chunks: s.chunks,
            },
        )
    }
    fn extents(s: &TopkFusedScalars, f: &KernelFacts) -> TopkFusedPtrs<Extent> {
        let (b, k) = (s.batch as u64, f.topk as u64);
        let (x, norm_w, lm_w) = refine(f, b);
        TopkFusedPtrs {
            logits: Extent::Elems(b * f.cols as u64),
            part: Extent::Elems(b * s.chunks as u64 * topk_record_floats(f.topk_cands()) as u64),
            hot_ids: hot(f),
            probs: Extent::Elems(b * k),
            ids: Extent::Elems(b * k),
            x,
            norm_w,
            lm_w,
            counters: Extent::Elems(b),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        stream(f),
        u("COLS", f.cols),
        u("TOPK", f.topk),
        u("CANDS", f.topk_cands()),
        ("REFINE".into(), ConstValue::Bool(f.refines_topk())),
        ("HEAD_NORM".into(), ConstValue::Bool(f.head_norm && f.refines_topk())),
        u("HIDDEN", f.hidden),
        ("EPS".into(), ConstValue::F32(f.eps)),
        ("HOT_MAP".into(), ConstValue::Bool(f.hot_map)),
        ("ID_OFFSET".into(), ConstValue::Bool(f.id_offset)),
        u("FULL_VOCAB", f.vocab),
        u("RANKS", f.tp_size),
        u("COL_OFFSET", f.col_offset()),
    ]
}
