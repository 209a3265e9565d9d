// select.cu: picks, per request, the hidden row of its last accepted token.
//
//   A = clamp(accept_lens[i], 1, N)
//   out[i, :] = x[i*N + A - 1, :]
//
// Entry:     select_rows
// Constants: act_t, stream_t, HIDDEN, N, EPS (unused here)
// Launch:    grid (batch, 1, 1), block (SELECT_ROWS_THREADS = 256, 1, 1), no dynamic shared memory.
// Params (by value, natural C alignment, fields in this order):
//   x            const stream_t*  [batch*N, HIDDEN]   rows of the residual stream (stream_t:
//                                                     float in an unsharded draft-extend
//                                                     phase, else act_t)
//   accept_lens  const int*       [batch]  accepted tokens per request (clamped to [1, N])
//   out          stream_t*        [batch, HIDDEN]
//   batch        unsigned         CTAs with blockIdx.x >= batch do nothing
// Pure copy: bit exact, 8-element vectors when the rows are 16-byte aligned.
//
// Entry:     select_norm (the last layer's residual add over the selected rows and the
//            post-attention norm of the sum, which feeds the MLP)
//   out[i, :]    = round_stream(x[i*N + A - 1, :] + add[i, :])   (fp32 sum, rounded once to
//                  stream_t: exact for an fp32 stream)
//   normed[i, :] = rmsnorm(out[i, :], weight)   (norm.cu's RMSNorm, eps EPS, of the rounded sum)
// Constants: act_t, stream_t, HIDDEN, N, EPS
// Launch:    grid (batch, 1, 1), block (SELECT_NORM_THREADS = 256, 1, 1), no dynamic shared memory.
// Params: x const stream_t* [batch*N, HIDDEN], accept_lens const int* [batch],
//         add const stream_t* [batch, HIDDEN], weight const act_t* [HIDDEN],
//         out stream_t* [batch, HIDDEN], normed act_t* [batch, HIDDEN], batch unsigned.
//         out may be null (a tensor-parallel rank other than 0 needs no sum: only rank 0's
//         down projection adds the residual).
//
// Entry:     select_norm_pairs (the selected rows' MLP over exact inputs, docs/semantics.md
//            "MLP pairs"): as select_norm, the norm written as a hi/lo pair of rows,
//   normed[2i, :] = hi = round(rmsnorm(out[i, :], weight)),  normed[2i + 1, :] = round(that - hi)
//   so the gate/up GEMM over the 2B rows computes W.hi and W.lo, which silu_mul_pairs sums.
// Constants, launch: as select_norm. Params (SelectNormPairsParams): as select_norm's, with
//         normed act_t* [2*batch, HIDDEN] and out never null (an unsharded plan only).
#include "common.cuh"

// SelectRowsParams and SelectNormParams are declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(SELECT_ROWS_THREADS) select_rows(SelectRowsParams p) {
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;
    constexpr long long H = (long long)HIDDEN;
    constexpr int kN = (int)N;

    int a = p.accept_lens[i];
    a = a < 1 ? 1 : (a > kN ? kN : a);
    const long long src_row = (long long)i * kN + (a - 1);
    parts_cast(p.out + (long long)i * H, p.x + src_row * H, H, 0, 1);
}

// Request i's selected row plus add[i] into out[i] (skipped when out is null) and its norm into
// normed (`normed_lo` non-null: as the hi/lo pair normed, normed_lo). Uniform per CTA.
__device__ __forceinline__ void select_norm_row(const stream_t* x, const int* accept_lens, const stream_t* add,
                                                const act_t* weight, stream_t* out, act_t* normed, act_t* normed_lo,
                                                unsigned i) {
    __shared__ float scratch[32];
    constexpr long long H = (long long)HIDDEN;
    constexpr int kN = (int)N;
    int a = accept_lens[i];
    a = a < 1 ? 1 : (a > kN ? kN : a);
    const stream_t* src = x + ((long long)i * kN + (a - 1)) * H;
    // The sum's copy comes from the norm's own loads (one memory latency, not two).
    rmsnorm_row(src, weight, normed, H, EPS, scratch, normed_lo,
                out != nullptr ? out + (long long)i * H : (stream_t*)nullptr, add + (long long)i * H);
}

extern "C" __global__ void __launch_bounds__(SELECT_NORM_THREADS) select_norm(SelectNormParams p) {
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;  // uniform per CTA
    select_norm_row(p.x, p.accept_lens, p.add, p.weight, p.out, p.normed + (long long)i * HIDDEN, nullptr, i);
}

extern "C" __global__ void __launch_bounds__(SELECT_NORM_PAIRS_THREADS) select_norm_pairs(SelectNormPairsParams p) {
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;  // uniform per CTA
    act_t* hi = p.normed + (long long)(2 * i) * HIDDEN;
    select_norm_row(p.x, p.accept_lens, p.add, p.weight, p.out, hi, hi + HIDDEN, i);
}
