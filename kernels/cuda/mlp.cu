// mlp.cu: SwiGLU activation of the fused gate/up projection.
//
//   out[r, c] = round(silu(g) * u),  g = gate_up[r, c], u = gate_up[r, INTER + c],
//   silu(g) = g / (1 + expf(-g)), all in fp32, one rounding to act_t.
//
// Entry:     silu_mul
// Constants: act_t, INTER
// Launch:    grid (rows, 1, 1), block (SILU_MUL_THREADS = 256, 1, 1), no dynamic shared memory.
// Params (by value, natural C alignment, fields in this order):
//   gate_up  const act_t*  [rows, 2*INTER]  gate in columns [0, INTER), up in [INTER, 2*INTER)
//   out      act_t*        [rows, INTER]
//   rows     unsigned      CTAs with blockIdx.x >= rows do nothing
// 16-byte vectors when INTER % 8 == 0 and the buffers are 16-byte aligned, else scalar.
#include "common.cuh"

// SiluMulParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

__device__ __forceinline__ float silu_times(float g, float u) {
    // For g -> -inf, expf(-g) = inf and g / inf = -0: no NaN.
    return g / (1.0f + expf(-g)) * u;
}

template <int V>
__device__ __forceinline__ void silu_mul_row(const act_t* gate, const act_t* up, act_t* out,
                                             long long begin, long long n) {
    // Element e of this thread's V-wide chunks: [begin + V*k, begin + V*k + V).
    for (long long e = begin + (long long)threadIdx.x * V; e + V <= n; e += (long long)blockDim.x * V) {
        float g[V], u[V], y[V];
        load_vec<V>(gate + e, g);
        load_vec<V>(up + e, u);
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = silu_times(g[k], u[k]);
        store_vec<V>(out + e, y);
    }
}

extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS) silu_mul(SiluMulParams p) {
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;
    constexpr long long I = (long long)INTER;

    const act_t* gate = p.gate_up + (long long)r * (2 * I);
    const act_t* up = gate + I;
    act_t* out = p.out + (long long)r * I;

    long long done = 0;
    if (aligned16(gate) && aligned16(up) && aligned16(out)) {
        silu_mul_row<8>(gate, up, out, 0, (I / 8) * 8);
        done = (I / 8) * 8;
    }
    silu_mul_row<1>(gate, up, out, done, I);  // tail (or everything when unaligned)
}
