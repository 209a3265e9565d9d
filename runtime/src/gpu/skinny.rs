//! The skinny GEMM (kernels/cuda/gemm.cu): the plan's own kernel for GEMMs of at most 16
//! rows, timed beside cuBLASLt's candidates when the runtime loads (`Lt::tune`) and kept
//! for a shape when it is faster. Every plan carries its instance (a runtime-launched
//! entry); the runtime launches it only for shapes that fit its contract.
//!
//! Why: for the few rows of small buckets a GEMM is a stream of its weights, and cuBLASLt's
//! candidates for such shapes leave bandwidth unused (the small o_proj at ~50% of the copy
//! ceiling); the kernel keeps every warp's weight loads in flight (docs/perf-notes.md,
//! "Skinny GEMM").

use specplan_format::DType;
use specplan_kernels::abi::{Abi, KernelParams};
use specplan_kernels::entries::gemm::{
    skinny_fits, SkinnyGemmParams, SkinnyGemmPtrs, SkinnyGemmScalars, SKINNY_GEMM_COLS, SKINNY_GEMM_THREADS,
};

use cudarc::driver::sys;

use super::device::GpuError;
use super::launch::{launch_packed, pack_slots};
use super::lt::{GemmPtrs, GemmShape};

/// The loaded `skinny_gemm` of a plan and the activation type it was specialized for.
#[derive(Clone, Copy)]
pub(crate) struct Skinny {
    pub func: sys::CUfunction,
    pub act: DType,
}

impl Skinny {
    /// Whether the kernel serves `s`: gemm.cu's contract (`skinny_fits`), A and W of the
    /// instance's activation type, C of that type or f32, every operand 16-byte aligned
    /// (`GemmShape::align`: the alignment class of the shape's pointers).
    pub fn serves(&self, s: &GemmShape) -> bool {
        let (m, n, k, lda) = (s.m as u64, s.n as u64, s.k as u64, s.lda as u64);
        skinny_fits(m, n, k, lda)
            && s.a == self.act
            && s.w == self.act
            && (s.c == self.act || s.c == DType::F32)
            && s.align >= 16
    }

    /// Issues `s` on `p` (eagerly or under capture); the caller checked [`Skinny::serves`].
    pub fn run(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        let args = SkinnyGemmParams::assemble(
            SkinnyGemmPtrs { a: p.a, w: p.w, c: p.c },
            SkinnyGemmScalars {
                m: s.m,
                n: s.n,
                k: s.k,
                lda: s.lda,
                accumulate: s.accumulate as u32,
                c_f32: (s.c == DType::F32) as u32,
            },
        );
        let mut blob = pack_slots(&Abi::of::<SkinnyGemmParams>(), &args);
        let grid = (s.n as u64).div_ceil(SKINNY_GEMM_COLS) as u32;
        launch_packed(
            self.func,
            [grid, 1, 1],
            [SKINNY_GEMM_THREADS, 1, 1],
            0,
            &mut blob,
            stream,
        )
    }
}
