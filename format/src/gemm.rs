//! A plan GEMM's launch descriptor (`LaunchKind::Gemm`).

use serde::{Deserialize, Serialize};

/// `C[m, n] (+)= A[m, k] · W[n, k]^T`, row-major, fp32 accumulation. (A bias is folded
/// by the compiler into a kernel that initializes C, so GEMMs carry none.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmDesc {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// A's row stride in elements (≥ k): A is the first `k` columns of an `[m, lda]` buffer
    /// (down reads the SwiGLU product in place in the gate half of the gate/up rows).
    pub lda: u64,
    pub a: u32,
    pub w: u32,
    pub c: u32,
    /// `true`: C += A·Wᵀ (the residual add folded into the GEMM, beta = 1).
    pub accumulate: bool,
    /// C's new values rounded to the activation type, also written into this `[m, n]` buffer
    /// (C is then f32; the `round_into_gemm` fusion). `None`: C only.
    pub rounded: Option<u32>,
}
