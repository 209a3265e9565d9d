// mlp.cu: SwiGLU activation of the fused gate/up projection, in place.
//
//   gate_up[r, c] := round(silu(g) * u),  g = gate_up[r, c], u = gate_up[r, INTER + c],
//   silu(g) = g / (1 + expf(-g)), all in fp32, one rounding to act_t.
//
// The product overwrites the gate half of each row (the down projection reads it as A with
// row stride 2*INTER), so no [rows, INTER] buffer is live beside the gate/up rows. Each
// element is read and then written by one thread only, which makes the overwrite safe.
//
// Entry:     silu_mul
// Constants: act_t, INTER
// Launch:    grid (rows, parts, 1), block (SILU_MUL_THREADS = 256, 1, 1), no dynamic shared memory;
//            parts = kernels::facts::row_parts (at most 8, 1 from 256 rows): CTA (r, y) takes every parts-th
//            256-thread slice of row r, so a short batch still spreads over several SMs
//            (one CTA walking a row waits for each load in turn).
// Params (by value, natural C alignment, fields in this order):
//   gate_up  act_t*        [rows, 2*INTER]  gate in columns [0, INTER), up in [INTER, 2*INTER);
//                                           the product replaces the gate columns
//   rows     unsigned      CTAs with blockIdx.x >= rows do nothing
// 16-byte vectors when INTER % 8 == 0 and the buffers are 16-byte aligned, else scalar.
//
// Entry:     silu_mul_pairs (the selected rows' MLP over exact inputs, docs/semantics.md
//            "MLP pairs"): the gate/up GEMM ran over select_norm_pairs' hi/lo rows into fp32,
//   g = gate_up[2r, c] + gate_up[2r + 1, c],  u = gate_up[2r, INTER + c] + gate_up[2r + 1, INTER + c],
//   out[r, c] = round(silu(g) * u)   (one rounding: the down GEMM's input)
// Constants: act_t, INTER
// Launch:    as silu_mul (grid (rows, parts, 1), SILU_MUL_PAIRS_THREADS = 256).
// Params (SiluMulPairsParams): gate_up const float* [2*rows, 2*INTER], out act_t* [rows, INTER],
//            rows unsigned. Not in place (the types differ): out is its own buffer.
#include "common.cuh"

// SiluMulParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

__device__ __forceinline__ float silu_times(float g, float u) {
    // For g -> -inf, expf(-g) = inf and g / inf = -0: no NaN.
    return g / (1.0f + expf(-g)) * u;
}

template <int V>
__device__ __forceinline__ void silu_mul_row(act_t* gate, const act_t* up, long long begin, long long n) {
    // Element e of this thread's V-wide chunks: [begin + V*k, begin + V*k + V); the row's
    // threads are the gridDim.y CTAs' of the row.
    const long long t = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    const long long stride = (long long)blockDim.x * gridDim.y * V;
    for (long long e = begin + t * V; e + V <= n; e += stride) {
        float g[V], u[V], y[V];
        load_vec<V>(gate + e, g);
        load_vec<V>(up + e, u);
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = silu_times(g[k], u[k]);
        store_vec<V>(gate + e, y);  // the chunk just read, by this thread only
    }
}

extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS) silu_mul(SiluMulParams p) {
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;
    constexpr long long I = (long long)INTER;

    act_t* gate = p.gate_up + (long long)r * (2 * I);
    const act_t* up = gate + I;

    long long done = 0;
    if (aligned16(gate) && aligned16(up)) {
        silu_mul_row<8>(gate, up, 0, (I / 8) * 8);
        done = (I / 8) * 8;
    }
    silu_mul_row<1>(gate, up, done, I);  // tail (or everything when unaligned)
}

template <int V>
__device__ __forceinline__ void silu_mul_pairs_row(const float* hi, const float* lo, act_t* out, long long begin,
                                                   long long n) {
    const long long t = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    const long long stride = (long long)blockDim.x * gridDim.y * V;
    constexpr long long I = (long long)INTER;
    for (long long e = begin + t * V; e + V <= n; e += stride) {
        float gh[V], gl[V], uh[V], ul[V], y[V];
        load_vec<V>(hi + e, gh);
        load_vec<V>(lo + e, gl);
        load_vec<V>(hi + I + e, uh);
        load_vec<V>(lo + I + e, ul);
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = silu_times(gh[k] + gl[k], uh[k] + ul[k]);
        store_vec<V>(out + e, y);
    }
}

extern "C" __global__ void __launch_bounds__(SILU_MUL_PAIRS_THREADS) silu_mul_pairs(SiluMulPairsParams p) {
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;
    constexpr long long I = (long long)INTER;

    const float* hi = p.gate_up + (long long)(2 * r) * (2 * I);
    const float* lo = hi + 2 * I;
    act_t* out = p.out + (long long)r * I;

    long long done = 0;
    if (I % 8 == 0 && aligned16(hi) && aligned16(out)) {
        silu_mul_pairs_row<8>(hi, lo, out, 0, I);
        done = I;
    }
    silu_mul_pairs_row<1>(hi, lo, out, done, I);  // everything when unaligned
}
