//! norm.cu: RMSNorm of activation rows.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{BucketFacts, KernelFacts};
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `rmsnorm`: `out[r] = x[r] · rsqrt(mean(x[r]²) + EPS) · weight`.
#[derive(KernelParams)]
#[repr(C)]
pub struct RmsNormParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    #[arg(weight)]
    pub weight: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

pub const NORM_THREADS: u32 = 256;

impl Kernel for RmsNormParams {
    const ENTRY: Entry = Entry::RmsNorm;
    fn threads(_: &KernelFacts) -> u32 {
        NORM_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], RmsNormScalars) {
        ([b.rows, 1, 1], RmsNormScalars { rows: b.rows })
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

pub fn constants(f: &KernelFacts) -> Constants {
    vec![act(f), u("HIDDEN", f.hidden), ("EPS".into(), ConstValue::F32(f.eps))]
}
