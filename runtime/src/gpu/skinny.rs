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
    gemm_round_ctas, skinny_fits, GemmRoundParams, GemmRoundPtrs, GemmRoundScalars, SkinnyGemmParams, SkinnyGemmPtrs,
    SkinnyGemmScalars, GEMM_ROUND_THREADS, SKINNY_GEMM_COLS, SKINNY_GEMM_THREADS,
};

use cudarc::driver::sys;

use super::device::GpuError;
use super::launch::{launch_packed, pack_slots};
use super::lt::{GemmPtrs, GemmShape};

/// The loaded `skinny_gemm` and `gemm_round` of a plan and the activation type they were
/// specialized for.
#[derive(Clone, Copy)]
pub(crate) struct Skinny {
    pub func: sys::CUfunction,
    /// `gemm_round`: a GEMM's rounded copy (`GemmDesc.rounded`) where the library ran it.
    pub round: sys::CUfunction,
    pub act: DType,
    /// The rounded copy in its own `gemm_round` launch even after the skinny GEMM, which
    /// otherwise writes it in its epilogue (`GpuOptions::split_gemm_round`: the A/B of
    /// the `round_into_gemm` fusion on one plan).
    pub split_round: bool,
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
            && (!s.rounded || s.c == DType::F32)
            && s.align >= 16
    }

    /// Issues `s` on `p` (eagerly or under capture); the caller checked [`Skinny::serves`].
    pub fn run(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        let c2 = if s.rounded && !self.split_round { p.r } else { 0 };
        let args = SkinnyGemmParams::assemble(
            SkinnyGemmPtrs {
                a: p.a,
                w: p.w,
                c: p.c,
                c2,
            },
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
        )?;
        if self.split_round {
            self.round_after(s, p, stream)?;
        }
        Ok(())
    }

    /// Issues `gemm_round` for shape `s`'s rounded copy, if it has one (`r[i] = round(c[i])`
    /// over the shape's m × n; a validated plan's copy holds at most 2^32 - 1 elements):
    /// after a GEMM that did not write it (the library's, or the skinny one with
    /// `split_round`).
    pub fn round_after(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        if !s.rounded {
            return Ok(());
        }
        let count = s.m as u64 * s.n as u64;
        let args = GemmRoundParams::assemble(
            GemmRoundPtrs { src: p.c, dst: p.r },
            GemmRoundScalars {
                count: count.min(u32::MAX as u64) as u32,
            },
        );
        let mut blob = pack_slots(&Abi::of::<GemmRoundParams>(), &args);
        launch_packed(
            self.round,
            [gemm_round_ctas(count), 1, 1],
            [GEMM_ROUND_THREADS, 1, 1],
            0,
            &mut blob,
            stream,
        )
    }
}
