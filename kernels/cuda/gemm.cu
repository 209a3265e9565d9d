// gemm.cu: a skinny GEMM for the few rows of small buckets, the runtime's alternative to
// cuBLASLt for a plan GEMM (runtime/src/gpu/lt.rs times it beside cuBLASLt's candidates
// at load and keeps whichever is faster per shape; a plan never launches it directly).
//
// Contract (row-major, as GemmDesc): C[m, n] (+)= A[m, k] . W[n, k]^T, fp32 accumulation,
// one rounding into C's type.
//   A: act_t, row r at a + r*lda; W: act_t [n, k]; C: act_t (c_f32 = 0) or float (1),
//   [m, n] dense; accumulate = 1 adds into C's values (the residual add, beta = 1).
//   c2 (only with c_f32; null: none): C's new values rounded to act_t, [m, n] dense, the
//   rounding `cast_rows` would apply to C (GemmDesc.rounded).
// Requires (the runtime's `skinny_eligible`): 1 <= m <= 16, n >= 1, k a multiple of 32,
// lda a multiple of 8 and >= k, a and w 16-byte aligned. Reads exactly A's m rows of k,
// W's n rows and C's m x n (with accumulate); writes C's m x n (and c2's, when given).
//
// Entry skinny_gemm: grid (ceil(n / 16), 1, 1), block (SKINNY_GEMM_THREADS = 256, 1, 1),
// no dynamic shared memory. Params (SkinnyGemmParams): a, w, c, c2, m, n, k, lda,
// accumulate, c_f32.
//
// Entry gemm_round: dst[i] = round(src[i]) for i < count, f32 to act_t: the rounded copy of
// a GEMM the library ran (cuBLASLt or cublasGemmEx cannot write one), or the skinny GEMM
// with the runtime's split_gemm_round (an A/B switch). Grid (ceil(count / (256 * 8)), 1, 1),
// block (GEMM_ROUND_THREADS = 256, 1, 1); each thread rounds 8 consecutive elements.
//
// Method (the weights are a stream read once; A is a few KB, served by L1/L2): CTA x
// owns output columns [16x, 16x + 16); its 8 warps split K in 32-wide steps (warp w takes
// steps w, w + 8, ...). Per step a lane loads 16 contiguous bytes of two W rows (g and
// g + 8, g = lane / 4) and of one A row per 8 rows of A, and the warp issues two
// mma.m16n8k16 per 8 rows of A with W as the 16-row operand. K is permuted inside the step
// (lane quad t holds k = 8t .. 8t+7 where the fragment layout names 2t, 2t+1, 2t+8, 2t+9
// and their second-mma twins): the same permutation on both operands leaves every dot
// product unchanged and lets every load be one 16-byte vector. Loads of kUnroll steps are
// issued before their mmas, so each warp keeps 4 KB in flight. The warps' partial tiles are
// summed in shared memory, in a fixed order (deterministic), and written with C's
// rounding. Measured against cuBLAS in docs/perf-notes.md ("Skinny GEMM").
#include "common.cuh"

namespace skinny {

constexpr int kWarps = (int)SKINNY_GEMM_THREADS / 32;
constexpr int kUnroll = 4;
static_assert(SKINNY_GEMM_THREADS % 32u == 0u && kWarps >= 1, "whole warps");

// One mma.m16n8k16 with fp32 accumulation, for the activation type's PTX name.
template <typename T> struct Mma;
#define SKINNY_MMA(T, PTX)                                                                        \
    template <> struct Mma<T> {                                                                   \
        static __device__ __forceinline__ void run(float (&d)[4], unsigned a0, unsigned a1,       \
                                                   unsigned a2, unsigned a3, unsigned b0,         \
                                                   unsigned b1) {                                 \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX                     \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"           \
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                 \
        }                                                                                         \
    };
SKINNY_MMA(__nv_bfloat16, "bf16")
SKINNY_MMA(__half, "f16")
#undef SKINNY_MMA

// A weight load: read once, so it does not displace A (and the other CTAs' rows) from L1.
__device__ __forceinline__ uint4 ld_stream(const act_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The two mmas of one 32-wide step: W rows g (wa) and g + 8 (wb), A row g of the tile (x).
__device__ __forceinline__ void step(float (&d)[4], uint4 wa, uint4 wb, uint4 x) {
    Mma<act_t>::run(d, wa.x, wb.x, wa.y, wb.y, x.x, x.y);
    Mma<act_t>::run(d, wa.z, wb.z, wa.w, wb.w, x.z, x.w);
}

// MT tiles of 8 rows of A (m <= 8 * MT).
template <int MT>
__device__ __forceinline__ void body(const SkinnyGemmParams& p) {
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long n0 = (long long)blockIdx.x * 16;
    const long long k = p.k;
    // Rows past n (the last tile) and past m read row 0 (it exists) and are not stored.
    const long long r0 = n0 + g < p.n ? n0 + g : 0, r1 = n0 + g + 8 < p.n ? n0 + g + 8 : 0;
    const act_t* w0 = p.w + r0 * k + t * 8;
    const act_t* w1 = p.w + r1 * k + t * 8;
    bool live[MT];
    const act_t* ap[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const unsigned row = (unsigned)(mt * 8 + g);
        live[mt] = row < p.m;
        ap[mt] = p.a + (long long)(live[mt] ? row : 0u) * p.lda + t * 8;
    }
    float d[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) d[mt][0] = d[mt][1] = d[mt][2] = d[mt][3] = 0.0f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const int steps = (int)(k / 32);
    int s = warp;
    for (; s + (kUnroll - 1) * kWarps < steps; s += kUnroll * kWarps) {
        uint4 wa[kUnroll], wb[kUnroll], x[kUnroll][MT];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const long long e = (long long)(s + u * kWarps) * 32;
            wa[u] = ld_stream(w0 + e);
            wb[u] = ld_stream(w1 + e);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) x[u][mt] = __ldg(reinterpret_cast<const uint4*>(ap[mt] + e));
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) step(d[mt], wa[u], wb[u], live[mt] ? x[u][mt] : zero);
    }
    for (; s < steps; s += kWarps) {
        const long long e = (long long)s * 32;
        const uint4 wa = ld_stream(w0 + e), wb = ld_stream(w1 + e);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint4 x = __ldg(reinterpret_cast<const uint4*>(ap[mt] + e));
            step(d[mt], wa, wb, live[mt] ? x : zero);
        }
    }
    // d[mt][0..1]: column n0 + g, rows mt*8 + 2t, +1; d[mt][2..3]: column n0 + g + 8.
    __shared__ float red[kWarps][MT * 4][32];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][mt * 4 + j][lane] = d[mt][j];
    __syncthreads();
    for (int i = (int)threadIdx.x; i < MT * 4 * 32; i += kWarps * 32) {
        const int q = i / 32, l = i % 32;
        float sum = 0.0f;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) sum += red[ww][q][l];
        const int mt = q / 4, j = q % 4;
        const unsigned row = (unsigned)(mt * 8 + (l & 3) * 2 + (j & 1));
        const long long col = n0 + (l >> 2) + (j >= 2 ? 8 : 0);
        if (row >= p.m || col >= p.n) continue;
        const long long at = (long long)row * p.n + col;
        if (p.c_f32) {
            float* c = p.c;
            const float v = p.accumulate ? c[at] + sum : sum;
            c[at] = v;
            if (p.c2 != nullptr) p.c2[at] = to_act(v);
        } else {
            act_t* c = reinterpret_cast<act_t*>(p.c);
            c[at] = to_act(p.accumulate ? to_f(c[at]) + sum : sum);
        }
    }
}

}  // namespace skinny

extern "C" __global__ void __launch_bounds__(SKINNY_GEMM_THREADS) skinny_gemm(SkinnyGemmParams p) {
    if (p.m == 0u || p.m > 16u || p.n == 0u || p.k % 32u != 0u) return;  // outside the contract: nothing
    if (p.m <= 8u) skinny::body<1>(p);
    else skinny::body<2>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_ROUND_THREADS) gemm_round(GemmRoundParams p) {
    const unsigned long long i0 = ((unsigned long long)blockIdx.x * GEMM_ROUND_THREADS + threadIdx.x) * 8ull;
    if (i0 >= p.count) return;
    const unsigned long long end = i0 + 8ull < p.count ? i0 + 8ull : (unsigned long long)p.count;
    // Loads before stores (every element in flight at once).
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = i0 + j < end ? p.src[i0 + j] : 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (i0 + j < end) p.dst[i0 + j] = to_act(v[j]);
}
