//! gemm.cu: the skinny GEMM, the runtime's alternative to cuBLASLt for a plan GEMM of at
//! most 16 rows (timed beside cuBLASLt's candidates at load; runtime/src/gpu/lt.rs), and
//! `gemm_round`, which writes a GEMM's rounded copy (`GemmDesc.rounded`) where a library,
//! which cannot, ran the GEMM.
//!
//! Every plan carries one instance of each but never launches them
//! (`Entry::runtime_launched`): their launches are the runtime's, from a validated
//! `GemmDesc` (whose operands the validator bounds), so the shapes declared here (grid 0)
//! describe no plan launch.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{BucketFacts, KernelFacts};
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::act;

/// `skinny_gemm`: `C[m, n] (+)= A[m, k]·W[n, k]ᵀ` (gemm.cu's contract).
#[derive(KernelParams)]
#[repr(C)]
pub struct SkinnyGemmParams {
    /// A, row r at `a + r·lda`.
    #[arg(buffer)]
    pub a: DevPtr<Act>,
    #[arg(weight)]
    pub w: DevPtr<Act>,
    /// C: `float` when `c_f32`, else `act_t` (the kernel casts).
    #[arg(buffer, rw)]
    pub c: DevPtrMut<f32>,
    /// C's new values rounded to `act_t`, `[m, n]` dense (`GemmDesc.rounded`; null: none,
    /// and only with `c_f32`).
    #[arg(buffer)]
    pub c2: DevPtrMut<Act>,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub lda: u32,
    pub accumulate: u32,
    pub c_f32: u32,
}

pub const SKINNY_GEMM_THREADS: u32 = 256;
/// Rows of A the kernel serves (two 8-row tiles of the mma).
pub const SKINNY_GEMM_MAX_M: u64 = 16;
/// Output columns per CTA.
pub const SKINNY_GEMM_COLS: u64 = 16;

/// Whether a GEMM of this shape fits gemm.cu's contract (the pointers' 16-byte alignment
/// is the runtime's to check): 1 ≤ m ≤ 16, k a positive multiple of 32, lda ≥ k and a
/// multiple of 8, and every index within u32.
pub fn skinny_fits(m: u64, n: u64, k: u64, lda: u64) -> bool {
    (1..=SKINNY_GEMM_MAX_M).contains(&m)
        && n >= 1
        && k >= 32
        && k.is_multiple_of(32)
        && lda >= k
        && lda.is_multiple_of(8)
        && [n, k, lda].iter().all(|&x| x <= u32::MAX as u64)
}

impl Kernel for SkinnyGemmParams {
    const ENTRY: Entry = Entry::SkinnyGemm;
    fn threads(_: &KernelFacts) -> u32 {
        SKINNY_GEMM_THREADS
    }
    /// Not a plan launch (the module docs): grid 0.
    fn launch(_: &BucketFacts, _: &KernelFacts) -> ([u32; 3], SkinnyGemmScalars) {
        (
            [0, 0, 0],
            SkinnyGemmScalars {
                m: 0,
                n: 0,
                k: 0,
                lda: 0,
                accumulate: 0,
                c_f32: 0,
            },
        )
    }
    fn extents(s: &SkinnyGemmScalars, _: &KernelFacts) -> SkinnyGemmPtrs<Extent> {
        let (m, n, k, lda) = (s.m as u64, s.n as u64, s.k as u64, s.lda as u64);
        SkinnyGemmPtrs {
            a: Extent::Elems(if m == 0 { 0 } else { (m - 1) * lda + k }),
            w: Extent::Elems(n * k),
            c: Extent::Elems(m * n),
            c2: Extent::Elems(m * n),
        }
    }
}

/// `gemm_round`: `dst[i] = round(src[i])` for `i < count` (f32 to `act_t`, the rounding of
/// `cast_rows` and of the skinny GEMM's `c2`): a GEMM's rounded copy where a library ran it.
#[derive(KernelParams)]
#[repr(C)]
pub struct GemmRoundParams {
    #[arg(buffer)]
    pub src: DevPtr<f32>,
    #[arg(buffer)]
    pub dst: DevPtrMut<Act>,
    pub count: u32,
}

pub const GEMM_ROUND_THREADS: u32 = 256;
/// Elements each thread of a `gemm_round` launch rounds (loaded together, then stored).
pub const GEMM_ROUND_PER_THREAD: u64 = 8;

/// CTAs of a `gemm_round` launch over `count` elements.
pub fn gemm_round_ctas(count: u64) -> u32 {
    count
        .div_ceil(GEMM_ROUND_THREADS as u64 * GEMM_ROUND_PER_THREAD)
        .clamp(1, u32::MAX as u64) as u32
}

impl Kernel for GemmRoundParams {
    const ENTRY: Entry = Entry::GemmRound;
    fn threads(_: &KernelFacts) -> u32 {
        GEMM_ROUND_THREADS
    }
    /// Not a plan launch (the module docs): grid 0.
    fn launch(_: &BucketFacts, _: &KernelFacts) -> ([u32; 3], GemmRoundScalars) {
        ([0, 0, 0], GemmRoundScalars { count: 0 })
    }
    fn extents(s: &GemmRoundScalars, _: &KernelFacts) -> GemmRoundPtrs<Extent> {
        GemmRoundPtrs {
            src: Extent::Elems(s.count as u64),
            dst: Extent::Elems(s.count as u64),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![act(f)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skinny_fits_names_its_contract() {
        // The draft heads' small-bucket shapes fit: o_proj, the fused fc, down's strided A.
        assert!(skinny_fits(4, 4096, 4096, 4096));
        assert!(skinny_fits(16, 4096, 8192, 8192));
        assert!(skinny_fits(1, 4096, 11008, 22016));
        // Outside: no rows, more than 16, k not a multiple of 32, lda below k or unaligned.
        assert!(!skinny_fits(0, 4096, 4096, 4096));
        assert!(!skinny_fits(17, 4096, 4096, 4096));
        assert!(!skinny_fits(4, 4096, 4080, 4096));
        assert!(!skinny_fits(4, 4096, 4096, 4088));
        assert!(!skinny_fits(4, 4096, 4096, 4100));
        assert!(!skinny_fits(4, 0, 4096, 4096));
        assert!(!skinny_fits(4, 1 << 33, 4096, 4096));
    }
}
