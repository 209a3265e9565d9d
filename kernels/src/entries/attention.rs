//! attention.cu: split-KV paged attention of the N draft rows, and the merge of splits.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{attn_last_cta_fits, attn_smem_bytes, BucketFacts, KernelFacts, ATTN_LAST_CTA_ROWS};
use crate::io;
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `attn_partial`: CTA (request, kv head, split) over its share of the keys. With one
/// split it writes `out`; with more, the partial results the merge combines.
#[derive(KernelParams)]
#[repr(C)]
pub struct AttnPartialParams {
    #[arg(buffer)]
    pub q: DevPtr<Act>,
    #[arg(k_cache)]
    pub k_cache: DevPtr<Act>,
    #[arg(v_cache)]
    pub v_cache: DevPtr<Act>,
    #[arg(input = io::REQ_SLOTS)]
    pub req_slots: DevPtr<i32>,
    #[arg(table)]
    pub page_table: DevPtr<i32>,
    /// The registered cache geometry (`kv.rs`).
    #[arg(layout)]
    pub kv_layout: DevPtr<i64>,
    #[arg(input = io::PREFIX_LENS)]
    pub prefix_lens: DevPtr<i32>,
    /// Over the selected query rows (`KernelFacts::select_from`): which row of each
    /// request's N is its query. Null otherwise.
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    /// Final output when there is one split, else null.
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    #[arg(buffer)]
    pub part_o: DevPtrMut<f32>,
    #[arg(buffer)]
    pub part_lse: DevPtrMut<f32>,
    pub batch: u32,
    pub splits: u32,
    pub q_stride: u32,
    /// CTAs per cluster along z: `splits` when the splits merge in their cluster (then
    /// `out` is written and the partials are unused), else 1.
    pub cluster: u32,
}

/// `attn_fused`: `attn_partial`'s CTAs over the splits of a bucket, each writing its
/// partials, and the merge (`attn_merge`'s) in whichever CTA of a (request, kv head) finishes
/// last, found by a per-group arrival counter: one launch instead of two, for instances of at
/// most [`ATTN_LAST_CTA_ROWS`] packed rows a CTA (`AttnFusedParams::serves`).
#[derive(KernelParams)]
#[repr(C)]
pub struct AttnFusedParams {
    #[arg(buffer)]
    pub q: DevPtr<Act>,
    #[arg(k_cache)]
    pub k_cache: DevPtr<Act>,
    #[arg(v_cache)]
    pub v_cache: DevPtr<Act>,
    #[arg(input = io::REQ_SLOTS)]
    pub req_slots: DevPtr<i32>,
    #[arg(table)]
    pub page_table: DevPtr<i32>,
    #[arg(layout)]
    pub kv_layout: DevPtr<i64>,
    #[arg(input = io::PREFIX_LENS)]
    pub prefix_lens: DevPtr<i32>,
    /// As `attn_partial`'s: the selected query rows' accept lengths, else null.
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    /// The splits' partials: written by each CTA, read back by its group's last.
    #[arg(buffer, local)]
    pub part_o: DevPtrMut<f32>,
    #[arg(buffer, local)]
    pub part_lse: DevPtrMut<f32>,
    /// One arrival counter a (request, kv head) (u32, zero before and after the launch).
    #[arg(counters, rw)]
    pub counters: DevPtrMut<i32>,
    pub batch: u32,
    pub splits: u32,
    pub q_stride: u32,
}

/// `attn_merge`: the log-sum-exp merge of the splits' partial results.
#[derive(KernelParams)]
#[repr(C)]
pub struct AttnMergeParams {
    #[arg(buffer)]
    pub part_o: DevPtr<f32>,
    #[arg(buffer)]
    pub part_lse: DevPtr<f32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
    pub splits: u32,
}

pub const ATTN_THREADS: u32 = 128;

impl Kernel for AttnPartialParams {
    const ENTRY: Entry = Entry::AttnPartial;
    fn threads(_: &KernelFacts) -> u32 {
        ATTN_THREADS
    }
    fn smem(f: &KernelFacts) -> u64 {
        let (tile, stages) = f.attn_tiling().unwrap_or((16, 2));
        attn_smem_bytes(f.n * f.group(), f.head_dim, tile, stages, f.act.size() as u32)
    }
    fn cluster(b: &BucketFacts, _: &KernelFacts) -> u32 {
        if b.attn_cluster {
            b.splits
        } else {
            1
        }
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], AttnPartialScalars) {
        (
            [b.batch, f.kv_heads, b.splits],
            AttnPartialScalars {
                batch: b.batch,
                splits: b.splits,
                q_stride: f.qkv_cols(),
                cluster: Self::cluster(b, f),
            },
        )
    }
    fn extents(s: &AttnPartialScalars, f: &KernelFacts) -> AttnPartialPtrs<Extent> {
        let (b, splits) = (s.batch as u64, s.splits as u64);
        let rows = b * f.n as u64;
        let hq = f.heads as u64;
        let hd = hq * f.head_dim as u64;
        let partials = splits > 1 && s.cluster <= 1;
        let split = |n: u64| if partials { Extent::Elems(n) } else { Extent::Unused };
        AttnPartialPtrs {
            q: Extent::Elems(b * f.q_rows() as u64 * s.q_stride as u64),
            k_cache: Extent::Elems(0),
            v_cache: Extent::Elems(0),
            req_slots: Extent::Elems(b),
            page_table: Extent::Elems(0),
            kv_layout: Extent::Elems(crate::kv::KV_WORDS as u64),
            prefix_lens: Extent::Elems(b),
            accept_lens: if f.select_from > 0 {
                Extent::Elems(b)
            } else {
                Extent::Unused
            },
            out: if partials {
                Extent::Unused
            } else {
                Extent::Elems(rows * hd)
            },
            part_o: split(splits * rows * hd),
            part_lse: split(splits * rows * hq),
        }
    }
}

/// The same pointers for the fused entry (`counters` added) and back: the two entries take
/// the same arguments but the counters.
impl<T> AttnPartialPtrs<T> {
    pub fn fused(self, counters: T) -> AttnFusedPtrs<T> {
        AttnFusedPtrs {
            q: self.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            req_slots: self.req_slots,
            page_table: self.page_table,
            kv_layout: self.kv_layout,
            prefix_lens: self.prefix_lens,
            accept_lens: self.accept_lens,
            out: self.out,
            part_o: self.part_o,
            part_lse: self.part_lse,
            counters,
        }
    }
}

impl<T> AttnFusedPtrs<T> {
    /// `attn_partial`'s arguments and the counters.
    pub fn unfused(self) -> (AttnPartialPtrs<T>, T) {
        let p = AttnPartialPtrs {
            q: self.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            req_slots: self.req_slots,
            page_table: self.page_table,
            kv_layout: self.kv_layout,
            prefix_lens: self.prefix_lens,
            accept_lens: self.accept_lens,
            out: self.out,
            part_o: self.part_o,
            part_lse: self.part_lse,
        };
        (p, self.counters)
    }
}

impl AttnFusedParams {
    /// Whether a bucket's launch of an instance is `attn_fused`: the bucket merges its splits
    /// in their last CTA (`BucketFacts::attn_last_cta`) and the instance has at most
    /// [`ATTN_LAST_CTA_ROWS`] packed rows a CTA (the last CTA reads all of its rows'
    /// partials; wider instances keep `attn_partial` and `attn_merge`).
    pub fn serves(b: &BucketFacts, f: &KernelFacts) -> bool {
        b.attn_last_cta
            && attn_last_cta_fits(b.batch, f.kv_heads, b.splits, b.attn_cluster)
            && f.n * f.group() <= ATTN_LAST_CTA_ROWS
    }
}

impl Kernel for AttnFusedParams {
    const ENTRY: Entry = Entry::AttnFused;
    fn threads(_: &KernelFacts) -> u32 {
        ATTN_THREADS
    }
    fn smem(f: &KernelFacts) -> u64 {
        AttnPartialParams::smem(f)
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], AttnFusedScalars) {
        (
            [b.batch, f.kv_heads, b.splits],
            AttnFusedScalars {
                batch: b.batch,
                splits: b.splits,
                q_stride: f.qkv_cols(),
            },
        )
    }
    fn extents(s: &AttnFusedScalars, f: &KernelFacts) -> AttnFusedPtrs<Extent> {
        let (b, splits) = (s.batch as u64, s.splits as u64);
        let rows = b * f.n as u64;
        let (hq, hd) = (f.heads as u64, (f.heads * f.head_dim) as u64);
        AttnFusedPtrs {
            q: Extent::Elems(b * f.q_rows() as u64 * s.q_stride as u64),
            k_cache: Extent::Elems(0),
            v_cache: Extent::Elems(0),
            req_slots: Extent::Elems(b),
            page_table: Extent::Elems(0),
            kv_layout: Extent::Elems(crate::kv::KV_WORDS as u64),
            prefix_lens: Extent::Elems(b),
            accept_lens: if f.select_from > 0 {
                Extent::Elems(b)
            } else {
                Extent::Unused
            },
            out: Extent::Elems(rows * hd),
            part_o: Extent::Elems(splits * rows * hd),
            part_lse: Extent::Elems(splits * rows * hq),
            counters: Extent::Elems(b * f.kv_heads as u64),
        }
    }
}

impl Kernel for AttnMergeParams {
    const ENTRY: Entry = Entry::AttnMerge;
    fn threads(f: &KernelFacts) -> u32 {
        f.head_dim
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], AttnMergeScalars) {
        // The instance's rows: the bucket's, or one per request over the selected queries.
        let rows = f.rows(b);
        ([rows, f.heads, 1], AttnMergeScalars { rows, splits: b.splits })
    }
    fn extents(s: &AttnMergeScalars, f: &KernelFacts) -> AttnMergePtrs<Extent> {
        let (rows, splits) = (s.rows as u64, s.splits as u64);
        let hq = f.heads as u64;
        let hd = hq * f.head_dim as u64;
        AttnMergePtrs {
            part_o: Extent::Elems(splits * rows * hd),
            part_lse: Extent::Elems(splits * rows * hq),
            out: Extent::Elems(rows * hd),
        }
    }
}

/// The three entries come from one source, so they share every constant.
pub fn constants(f: &KernelFacts) -> Constants {
    let (tile, stages) = f.attn_tiling().unwrap_or((16, 2));
    let mut c = vec![act(f)];
    c.extend(super::rope::paged_kv(f));
    c.extend([
        u("WINDOW", f.window),
        ("SCALE".into(), ConstValue::F32(1.0 / (f.head_dim as f32).sqrt())),
        u("KV_TILE", tile),
        u("STAGES", stages),
        u("SELECT_FROM", f.select_from),
    ]);
    c
}
