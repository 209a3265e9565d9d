//! norm.cu: RMSNorm of activation rows.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel, Stream};
use crate::facts::{row_parts, BucketFacts, KernelFacts};
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, stream, u};

/// `rmsnorm`: `out[r] = x[r] · rsqrt(mean(x[r]²) + EPS) · weight` (x a row of the stream).
#[derive(KernelParams)]
#[repr(C)]
pub struct RmsNormParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(weight)]
    pub weight: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

/// `norm_concat` (EAGLE-3's layer-0 input under a vocabulary-parallel embedding, after the
/// all-reduce of `embed(ids) ‖ h`): `out[r] = rmsnorm(x[r, :H], w_a) ‖ rmsnorm(x[r, H:], w_b)`.
#[derive(KernelParams)]
#[repr(C)]
pub struct NormConcatParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    #[arg(weight)]
    pub w_a: DevPtr<Act>,
    #[arg(weight)]
    pub w_b: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

impl Kernel for NormConcatParams {
    const ENTRY: Entry = Entry::NormConcat;
    fn threads(_: &KernelFacts) -> u32 {
        NORM_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], NormConcatScalars) {
        let rows = f.rows(b);
        // One CTA per half: the two norms run side by side.
        ([rows, 2, 1], NormConcatScalars { rows })
    }
    fn extents(s: &NormConcatScalars, f: &KernelFacts) -> NormConcatPtrs<Extent> {
        let (rows, h) = (s.rows as u64, f.hidden as u64);
        NormConcatPtrs {
            x: Extent::Elems(rows * 2 * h),
            w_a: Extent::Elems(h),
            w_b: Extent::Elems(h),
            out: Extent::Elems(rows * 2 * h),
        }
    }
}

/// `cast_rows`: `out[r] = round(x[r])`, rows of the fp32 stream into the activation type (the
/// one rounding of the stream: `hidden_out`, and EAGLE-1's layer-0 input, whose norm is the
/// identity).
#[derive(KernelParams)]
#[repr(C)]
pub struct CastRowsParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

impl Kernel for CastRowsParams {
    const ENTRY: Entry = Entry::CastRows;
    fn threads(_: &KernelFacts) -> u32 {
        NORM_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], CastRowsScalars) {
        let rows = f.rows(b);
        // A short batch spreads each row over several CTAs (8 elements a thread).
        let parts = row_parts(rows, (f.hidden as u64).div_ceil(8), NORM_THREADS);
        ([rows, parts, 1], CastRowsScalars { rows })
    }
    fn extents(s: &CastRowsScalars, f: &KernelFacts) -> CastRowsPtrs<Extent> {
        let n = s.rows as u64 * f.hidden as u64;
        CastRowsPtrs {
            x: Extent::Elems(n),
            out: Extent::Elems(n),
        }
    }
}

/// `norm_cast` (EAGLE-3's head over the fp32 stream's selected rows): `cast[r] = round(x[r])`
/// (`hidden_out`) and `out[r] = rmsnorm(x[r])` (lm_head's input), one launch for the two
/// readers of the rows (`cast_rows` then `rmsnorm` before the `norm_cast` pass).
#[derive(KernelParams)]
#[repr(C)]
pub struct NormCastParams {
    #[arg(buffer)]
    pub x: DevPtr<Stream>,
    #[arg(weight)]
    pub weight: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    #[arg(buffer)]
    pub cast: DevPtrMut<Act>,
    pub rows: u32,
}

impl Kernel for NormCastParams {
    const ENTRY: Entry = Entry::NormCast;
    fn threads(_: &KernelFacts) -> u32 {
        NORM_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], NormCastScalars) {
        let rows = f.rows(b);
        ([rows, 1, 1], NormCastScalars { rows })
    }
    fn extents(s: &NormCastScalars, f: &KernelFacts) -> NormCastPtrs<Extent> {
        let (rows, h) = (s.rows as u64, f.hidden as u64);
        NormCastPtrs {
            x: Extent::Elems(rows * h),
            weight: Extent::Elems(h),
            out: Extent::Elems(rows * h),
            cast: Extent::Elems(rows * h),
        }
    }
}

pub const NORM_THREADS: u32 = 256;

impl Kernel for RmsNormParams {
    const ENTRY: Entry = Entry::RmsNorm;
    fn threads(_: &KernelFacts) -> u32 {
        NORM_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], RmsNormScalars) {
        let rows = f.rows(b);
        ([rows, 1, 1], RmsNormScalars { rows })
    }
    fn extents(s: &RmsNormScalars, f: &KernelFacts) -> RmsNormPtrs<Extent> {
        let (rows, h) = (s.rows as u64, f.hidden as u64);
        RmsNormPtrs {
            x: Extent::Elems(rows * h),
            weight: Extent::Elems(h),
            out: Extent::Elems(rows * h),
        }
    }
}

/// `N` (rows per request) is not used by the source: it tells an instance over every row
/// of the phase from one over the selected rows (`KernelFacts::selected_rows`), whose
/// launches cover `batch · N` rows.
pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        stream(f),
        u("HIDDEN", f.hidden),
        ("EPS".into(), ConstValue::F32(f.eps)),
        u("N", f.n),
    ]
}
