//! select.cu: the row of each request that feeds the next top-K.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{BucketFacts, KernelFacts};
use crate::io;
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `select_rows`: `out[i] = x[i·N + A_i − 1]`, `A_i` clamped to `[1, N]`.
#[derive(KernelParams)]
#[repr(C)]
pub struct SelectRowsParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    #[arg(input = io::ACCEPT_LENS)]
    pub accept_lens: DevPtr<i32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub batch: u32,
}

pub const SELECT_THREADS: u32 = 256;

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
    vec![act(f), u("HIDDEN", f.hidden), u("N", f.n)]
}
