//! mlp.cu: the gated activation between the gate/up and down projections.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{row_parts, BucketFacts, KernelFacts};
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `silu_mul`: `gate_up[r, c] := silu(gate_up[r, c]) · gate_up[r, INTER + c]` for
/// `c < INTER`, in place over the gate half (the down GEMM reads it with row stride 2·INTER).
#[derive(KernelParams)]
#[repr(C)]
pub struct SiluMulParams {
    #[arg(buffer, rw)]
    pub gate_up: DevPtrMut<Act>,
    pub rows: u32,
}

pub const SILU_THREADS: u32 = 256;

impl Kernel for SiluMulParams {
    const ENTRY: Entry = Entry::SiluMul;
    fn threads(_: &KernelFacts) -> u32 {
        SILU_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], SiluMulScalars) {
        let rows = f.rows(b);
        let parts = row_parts(rows, (f.intermediate as u64).div_ceil(8), SILU_THREADS);
        ([rows, parts, 1], SiluMulScalars { rows })
    }
    fn extents(s: &SiluMulScalars, f: &KernelFacts) -> SiluMulPtrs<Extent> {
        let (rows, i) = (s.rows as u64, f.intermediate as u64);
        SiluMulPtrs {
            gate_up: Extent::Elems(rows * 2 * i),
        }
    }
}

/// `silu_mul_pairs`: the selected rows' MLP over exact inputs (docs/semantics.md, "MLP
/// pairs"): `gate_up` holds fp32 `W·hi` and `W·lo` in rows `2r` and `2r + 1` (the GEMM over
/// `select_norm_pairs`' rows); `out[r, c] = silu(g) · u` with `g`, `u` the pairs' sums, one
/// rounding. Not in place: `out` is its own `[rows, INTER]` buffer.
#[derive(KernelParams)]
#[repr(C)]
pub struct SiluMulPairsParams {
    #[arg(buffer)]
    pub gate_up: DevPtr<f32>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

impl Kernel for SiluMulPairsParams {
    const ENTRY: Entry = Entry::SiluMulPairs;
    fn threads(_: &KernelFacts) -> u32 {
        SILU_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], SiluMulPairsScalars) {
        let rows = f.rows(b);
        let parts = row_parts(rows, (f.intermediate as u64).div_ceil(8), SILU_THREADS);
        ([rows, parts, 1], SiluMulPairsScalars { rows })
    }
    fn extents(s: &SiluMulPairsScalars, f: &KernelFacts) -> SiluMulPairsPtrs<Extent> {
        let (rows, i) = (s.rows as u64, f.intermediate as u64);
        SiluMulPairsPtrs {
            gate_up: Extent::Elems(2 * rows * 2 * i),
            out: Extent::Elems(rows * i),
        }
    }
}

/// `N` (rows per request) is not used by the source: it tells an instance over every row
/// of the phase from one over the selected rows (`KernelFacts::selected_rows`).
pub fn constants(f: &KernelFacts) -> Constants {
    vec![act(f), u("INTER", f.intermediate), u("N", f.n)]
}
