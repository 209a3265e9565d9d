// norm.cu: RMSNorm of each row of the residual stream, and the stream's rounding.
//
//   inv = rsqrtf(mean_c(x[r, c]^2) + EPS)
//   out[r, c] = round(x[r, c] * inv * weight[c])
// with x, weight read as fp32, every step in fp32 and one rounding to act_t at the store.
// x is a row of the stream: stream_t is float in an unsharded draft-extend phase, act_t
// elsewhere (specplan_kernels::facts::KernelFacts::stream).
//
// Entry:     rmsnorm
// Constants: act_t, stream_t, HIDDEN, EPS, N (unused here)
// Launch:    grid (rows, 1, 1), block (RMSNORM_THREADS = 256, 1, 1), no dynamic shared memory
//            (128 bytes of static shared memory for the block reduction).
// Params (by value, natural C alignment, fields in this order):
//   x       const stream_t*  [rows, HIDDEN]
//   weight  const act_t*     [HIDDEN]
//   out     act_t*           [rows, HIDDEN]   (may alias x when stream_t is act_t: every
//                                              element is read before the barrier of the
//                                              reduction and written after it by the
//                                              thread that read it)
//   rows    unsigned         CTAs with blockIdx.x >= rows do nothing
// The row is read twice (sum of squares, then scaling); the second read hits L1/L2.
//
// Entry:     norm_concat (EAGLE-3's layer-0 input after a vocabulary-parallel embedding's
//            all-reduce of embed(ids) ‖ h)
//   out[r, 0:HIDDEN]        = rmsnorm(x[r, 0:HIDDEN], w_a)
//   out[r, HIDDEN:2*HIDDEN] = rmsnorm(x[r, HIDDEN:2*HIDDEN], w_b), each as rmsnorm above.
// Launch:    grid (rows, 2, 1), block (NORM_CONCAT_THREADS = 256, 1, 1): CTA (r, y) normalizes
//            half y of row r.
// Params:    x const act_t* [rows, 2*HIDDEN], w_a, w_b const act_t* [HIDDEN],
//            out act_t* [rows, 2*HIDDEN], rows unsigned
//
// Entry:     cast_rows (the stream's one rounding: hidden_out, and EAGLE-1's layer-0 input,
//            where the GEMM writing the stream does not write it: GemmDesc.rounded)
//   out[r, c] = round(x[r, c])
// Launch:    grid (rows, parts, 1), block (CAST_ROWS_THREADS = 256, 1, 1), no shared memory;
//            parts = kernels::facts::row_parts: CTA (r, y) converts every parts-th slice.
// Params:    x const stream_t* [rows, HIDDEN], out act_t* [rows, HIDDEN], rows unsigned
//
// Entry:     norm_cast (EAGLE-3's head over the fp32 stream's selected rows: hidden_out and
//            lm_head's input from one launch, the `norm_cast` pass)
//   cast[r, c] = round(x[r, c])                  (as cast_rows)
//   out[r, :]  = rmsnorm(x[r, :], weight)        (as rmsnorm)
// Launch:    grid (rows, 1, 1), block (NORM_CAST_THREADS = 256, 1, 1), no dynamic shared memory.
// Params:    x const stream_t* [rows, HIDDEN], weight const act_t* [HIDDEN],
//            out act_t* [rows, HIDDEN], cast act_t* [rows, HIDDEN], rows unsigned
#include "common.cuh"

// RmsNormParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS) rmsnorm(RmsNormParams p) {
    __shared__ float scratch[32];
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;  // uniform per CTA: no thread reaches the barrier below
    constexpr long long H = (long long)HIDDEN;
    rmsnorm_row(p.x + (long long)r * H, p.weight, p.out + (long long)r * H, H, EPS, scratch);
}

extern "C" __global__ void __launch_bounds__(NORM_CONCAT_THREADS) norm_concat(NormConcatParams p) {
    __shared__ float scratch[32];
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;  // uniform per CTA
    constexpr long long H = (long long)HIDDEN;
    const act_t* x = p.x + (long long)r * (2 * H);
    act_t* out = p.out + (long long)r * (2 * H);
    if (blockIdx.y == 0) {  // uniform per CTA
        rmsnorm_row(x, p.w_a, out, H, EPS, scratch);
    } else {
        rmsnorm_row(x + H, p.w_b, out + H, H, EPS, scratch);
    }
}

extern "C" __global__ void __launch_bounds__(CAST_ROWS_THREADS) cast_rows(CastRowsParams p) {
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;
    constexpr long long H = (long long)HIDDEN;
    parts_cast(p.out + (long long)r * H, p.x + (long long)r * H, H, blockIdx.y, gridDim.y);
}

extern "C" __global__ void __launch_bounds__(NORM_CAST_THREADS) norm_cast(NormCastParams p) {
    __shared__ float scratch[32];
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;  // uniform per CTA
    constexpr long long H = (long long)HIDDEN;
    // The rounding is stored from the norm's own loads of the row (one memory latency, not
    // two); the norm reads the source row, not the rounded copy, like rmsnorm.
    rmsnorm_row(p.x + (long long)r * H, p.weight, p.out + (long long)r * H, H, EPS, scratch, (act_t*)nullptr,
                p.cast + (long long)r * H);
}
