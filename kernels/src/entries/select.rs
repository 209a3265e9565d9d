//! select.cu: the row of each request that feeds the next top-K.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel, Stream};
use crate::facts::{BucketFacts, KernelFacts};
use crate::io;
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, stream, u};

/// `select_rows`: `out[i] = x[i·N + A_i − 1]`, `A_i` clamped to `[1, N]`.
#[derive(KernelParams)]
#[repr(C)]
pub struct SelectRowsParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Stream>,
    pub batch: u32,
}

/// `select_norm`: `out[i] = x[i·N + A_i − 1] + add[i]` (the selected row of the stream plus
/// the attention's output row over it: the residual of the last layer's MLP, rounded to the
/// stream's type) and `normed[i] = rmsnorm(out[i], weight)` (the MLP's input). On a
/// tensor-parallel rank other than 0, `out` is null: only rank 0's down projection adds the
/// residual (`residual_into_all_reduce`), so no other rank reads the selected rows.
#[derive(KernelParams)]
#[repr(C)]
pub struct SelectNormParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    /// `[batch, HIDDEN]`: the o projection of the selected rows' attention.
    #[arg(buffer)]
    pub add: DevPtr<Stream>,
    #[arg(weight)]
    pub weight: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Stream>,
    #[arg(buffer)]
    pub normed: DevPtrMut<Act>,
    pub batch: u32,
}

/// `select_norm_pairs`: as `select_norm` (an unsharded plan: `out` is never null), with
/// the norm written as a hi/lo pair of rows, `normed[2i] = hi = round(y)` and
/// `normed[2i + 1] = round(y − hi)` for `y = rmsnorm(out[i], weight)`: the gate/up GEMM
/// over the `2B` rows reads the fp32 norm to ~2^-16 (docs/semantics.md, "MLP pairs").
#[derive(KernelParams)]
#[repr(C)]
pub struct SelectNormPairsParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    /// `[batch, HIDDEN]`: the o projection of the selected rows' attention.
    #[arg(buffer)]
    pub add: DevPtr<Stream>,
    #[arg(weight)]
    pub weight: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Stream>,
    #[arg(buffer)]
    pub normed: DevPtrMut<Act>,
    pub batch: u32,
}

pub const SELECT_THREADS: u32 = 256;

impl Kernel for SelectNormPairsParams {
    const ENTRY: Entry = Entry::SelectNormPairs;
    fn threads(_: &KernelFacts) -> u32 {
        SELECT_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], SelectNormPairsScalars) {
        ([b.batch, 1, 1], SelectNormPairsScalars { batch: b.batch })
    }
    fn extents(s: &SelectNormPairsScalars, f: &KernelFacts) -> SelectNormPairsPtrs<Extent> {
        let (b, h) = (s.batch as u64, f.hidden as u64);
        SelectNormPairsPtrs {
            x: Extent::Elems(b * f.n as u64 * h),
            accept_lens: Extent::Elems(b),
            add: Extent::Elems(b * h),
            weight: Extent::Elems(h),
            out: Extent::Elems(b * h),
            normed: Extent::Elems(2 * b * h),
        }
    }
}

impl Kernel for SelectNormParams {
    const ENTRY: Entry = Entry::SelectNorm;
    fn threads(_: &KernelFacts) -> u32 {
        SELECT_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], SelectNormScalars) {
        ([b.batch, 1, 1], SelectNormScalars { batch: b.batch })
    }
    fn extents(s: &SelectNormScalars, f: &KernelFacts) -> SelectNormPtrs<Extent> {
        let (b, h) = (s.batch as u64, f.hidden as u64);
        SelectNormPtrs {
            x: Extent::Elems(b * f.n as u64 * h),
            accept_lens: Extent::Elems(b),
            add: Extent::Elems(b * h),
            weight: Extent::Elems(h),
            out: if f.tp_rank > 0 {
                Extent::Unused
            } else {
                Extent::Elems(b * h)
            },
            normed: Extent::Elems(b * h),
        }
    }
}

impl Kernel for SelectRowsParams {
    const ENTRY: Entry = Entry::SelectRows;
    fn threads(_: &KernelFacts) -> u32 {
        SELECT_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], SelectRowsScalars) {
        ([b.batch, 1, 1], SelectRowsScalars { batch: b.batch })
    }
    fn extents(s: &SelectRowsScalars, f: &KernelFacts) -> SelectRowsPtrs<Extent> {
        let (b, h) = (s.batch as u64, f.hidden as u64);
        SelectRowsPtrs {
            x: Extent::Elems(b * f.n as u64 * h),
            accept_lens: Extent::Elems(b),
            out: Extent::Elems(b * h),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        stream(f),
        u("HIDDEN", f.hidden),
        u("N", f.n),
        ("EPS".into(), crate::source::ConstValue::F32(f.eps)),
    ]
}
