// common.cuh: device helpers shared by every specplan kernel template.
//
// The plan compiler does not hand this file to NVRTC as a header. It pastes the file's
// text over the line `#include "common.cuh"` in a template, after the generated prelude.
// The prelude has already included <cuda_bf16.h> and <cuda_fp16.h>, declared
// `act_t` (__nv_bfloat16 or __half), the template's constexpr constants and the K/V layout
// word indices (KV_WORD_*, KV_MODE_TOKENS; from specplan_kernels::kv). So this file
// includes nothing and reads no constant except those.
//
// Contents:
//   * scalar conversions: to_f(act_t or float) -> float, from_f<T>(float), to_act(float),
//     all rounding to nearest even;
//   * conversions for 2, 4 and 8 elements packed in 32, 64 and 128 bits, used for
//     vectorized global and shared memory traffic (load_vec / store_vec), and the same for
//     fp32 rows (the residual stream);
//   * alignment tests, ceil_div, block-wide row copies and converting copies (parts_cast);
//   * rmsnorm_row over an act_t or fp32 row (its output optionally as hi/lo pairs);
//   * warp and block sum/max reductions;
//   * neg_inf() (NVRTC has no <cmath>, so no INFINITY macro);
//   * KvLayout: the registered K/V cache and page-table geometry, and the token slot of a
//     request's position (kv_row, kv_token).
//
// Every function is `__device__ __forceinline__` (NVRTC runs without -default-device).
// Sizes and offsets of device memory are computed in 64-bit (`long long`).

#ifndef SPECPLAN_COMMON_CUH
#define SPECPLAN_COMMON_CUH

// ---------------------------------------------------------------------------------
// Scalar conversions (fp32 math, one rounding to nearest even when storing).
// ---------------------------------------------------------------------------------
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }

__device__ __forceinline__ act_t to_act(float x) { return from_f<act_t>(x); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------------
// Bit-level packing of two 16-bit activations in one 32-bit word (element 0 in the low
// half, as in memory on a little-endian GPU). Building on raw bits avoids type-punning
// the cuda_bf16/cuda_fp16 struct types.
// ---------------------------------------------------------------------------------
template <typename T> struct ActBits;
template <> struct ActBits<__nv_bfloat16> {
    static __device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
    static __device__ __forceinline__ unsigned bits(float x) {
        return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
};
template <> struct ActBits<__half> {
    static __device__ __forceinline__ float lo(unsigned w) {
        return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
    }
    static __device__ __forceinline__ float hi(unsigned w) {
        return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
    }
    static __device__ __forceinline__ unsigned bits(float x) {
        return (unsigned)__half_as_ushort(__float2half_rn(x));
    }
};

__device__ __forceinline__ void unpack2(unsigned w, float& a, float& b) {
    a = ActBits<act_t>::lo(w);
    b = ActBits<act_t>::hi(w);
}
__device__ __forceinline__ unsigned pack2(float a, float b) {
    return ActBits<act_t>::bits(a) | (ActBits<act_t>::bits(b) << 16);
}

// ---------------------------------------------------------------------------------
// Loads and stores of V consecutive activations, converted to and from fp32. V = 2, 4, 8
// are single 32/64/128-bit accesses and need `p` aligned to V * 2 bytes; any other V is
// done element by element. The pointers may be global or shared (generic addressing).
// ---------------------------------------------------------------------------------
template <int V> __device__ __forceinline__ void load_vec(const act_t* p, float (&f)[V]) {
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = to_f(p[k]);  // any width: element by element
}
template <> __device__ __forceinline__ void load_vec<2>(const act_t* p, float (&f)[2]) {
    unpack2(*reinterpret_cast<const unsigned*>(p), f[0], f[1]);
}
template <> __device__ __forceinline__ void load_vec<4>(const act_t* p, float (&f)[4]) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    unpack2(r.x, f[0], f[1]);
    unpack2(r.y, f[2], f[3]);
}
// Eight activations already loaded as one 16-byte vector.
__device__ __forceinline__ void unpack8(uint4 r, float (&f)[8]) {
    unpack2(r.x, f[0], f[1]);
    unpack2(r.y, f[2], f[3]);
    unpack2(r.z, f[4], f[5]);
    unpack2(r.w, f[6], f[7]);
}
template <> __device__ __forceinline__ void load_vec<8>(const act_t* p, float (&f)[8]) {
    unpack8(*reinterpret_cast<const uint4*>(p), f);
}

template <int V> __device__ __forceinline__ void store_vec(act_t* p, const float (&f)[V]) {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = to_act(f[k]);  // any width: element by element
}
template <> __device__ __forceinline__ void store_vec<2>(act_t* p, const float (&f)[2]) {
    *reinterpret_cast<unsigned*>(p) = pack2(f[0], f[1]);
}
template <> __device__ __forceinline__ void store_vec<4>(act_t* p, const float (&f)[4]) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
}
template <> __device__ __forceinline__ void store_vec<8>(act_t* p, const float (&f)[8]) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// fp32 values as a pair of activations, hi = round(x) and lo = round(x - hi) (x - hi is
// exact in fp32): hi + lo carries x to about 2^-16 of it in bf16, where hi alone keeps
// 2^-9. A GEMM over the pair's rows computes W.hi and W.lo and its reader sums them: an
// fp32 input through a 16-bit GEMM (the selected rows' MLP, docs/semantics.md "MLP pairs").
template <int V> __device__ __forceinline__ void store_vec_split(act_t* hi, act_t* lo, const float (&f)[V]) {
    float h[V], l[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        h[k] = to_f(to_act(f[k]));
        l[k] = f[k] - h[k];
    }
    store_vec<V>(hi, h);  // h is representable: stored exactly
    store_vec<V>(lo, l);
}

// The same for fp32 rows (the residual stream, `stream_t` = float): V = 2, 4, 8 are
// 8- and 16-byte accesses and need `p` aligned to min(V, 4) * 4 bytes.
template <int V> __device__ __forceinline__ void load_vec(const float* p, float (&f)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            const float4 r = *reinterpret_cast<const float4*>(p + k);
            f[k] = r.x, f[k + 1] = r.y, f[k + 2] = r.z, f[k + 3] = r.w;
        }
    } else if constexpr (V == 2) {
        const float2 r = *reinterpret_cast<const float2*>(p);
        f[0] = r.x, f[1] = r.y;
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = p[k];
    }
}
template <int V> __device__ __forceinline__ void store_vec(float* p, const float (&f)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) *reinterpret_cast<float4*>(p + k) = make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]);
    } else if constexpr (V == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) p[k] = f[k];
    }
}

// Raw copy of V consecutive activations (bit exact, no conversion).
template <int V> __device__ __forceinline__ void copy_vec(act_t* dst, const act_t* src) {
#pragma unroll
    for (int k = 0; k < V; ++k) dst[k] = src[k];
}
template <> __device__ __forceinline__ void copy_vec<8>(act_t* dst, const act_t* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

// ---------------------------------------------------------------------------------
// Small integer helpers.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}
__host__ __device__ __forceinline__ constexpr long long ceil_div(long long a, long long b) {
    return (a + b - 1) / b;
}
__host__ __device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }

// Raw copy of 16-byte vectors v = t, t + stride, ... < nv, four in flight per thread: a group's
// loads are issued before its stores. In a plain loop the compiler cannot move a load above
// the previous iteration's store (the rows may alias, for all it knows), so every iteration
// costs a whole memory latency (perf-notes item 41).
__device__ __forceinline__ void copy16_strided(uint4* dst, const uint4* src, long long nv, long long t,
                                               long long stride) {
    for (long long v = t; v < nv; v += 4 * stride) {
        uint4 r[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) r[q] = v + q * stride < nv ? src[v + q * stride] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (v + q * stride < nv) dst[v + q * stride] = r[q];
        }
    }
}

// Part `part` of `parts` of a copy spread over several CTAs (each copies every parts-th
// blockDim.x-vector slice); block_copy_act is the one-CTA case.
__device__ __forceinline__ void parts_copy_act(act_t* dst, const act_t* src, long long n, unsigned part,
                                               unsigned parts) {
    const long long t = (long long)part * blockDim.x + threadIdx.x, stride = (long long)blockDim.x * parts;
    long long done = 0;
    if (aligned16(dst) && aligned16(src)) {
        const long long nv = n / 8;
        copy16_strided(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), nv, t, stride);
        done = nv * 8;
    }
    for (long long e = done + t; e < n; e += stride) dst[e] = src[e];
}

template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

// Part `part` of `parts` of a converting copy dst[e] = (D) src[e] (fp32 <-> act_t, one
// rounding to nearest even into a 16-bit type; a raw, bit-exact copy when D and S are one
// type), 8-element vectors when both rows are 16-byte aligned.
template <typename D, typename S>
__device__ __forceinline__ void parts_cast(D* dst, const S* src, long long n, unsigned part, unsigned parts) {
    const long long t = (long long)part * blockDim.x + threadIdx.x, stride = (long long)blockDim.x * parts;
    if constexpr (SameType<D, S>::value) {
        if constexpr (SameType<D, act_t>::value) {
            parts_copy_act(dst, src, n, part, parts);
        } else {
            constexpr long long per = 16 / (long long)sizeof(D);  // elements a 16-byte vector
            long long done = 0;
            if (aligned16(dst) && aligned16(src)) {
                copy16_strided(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), n / per, t,
                               stride);
                done = n / per * per;
            }
            for (long long e = done + t; e < n; e += stride) dst[e] = src[e];
        }
        return;
    }
    long long done = 0;
    if (aligned16(dst) && aligned16(src)) {
        const long long nv = n / 8;
        for (long long v = t; v < nv; v += stride) {
            float f[8];
            load_vec<8>(src + v * 8, f);
            store_vec<8>(dst + v * 8, f);
        }
        done = nv * 8;
    }
    for (long long e = done + t; e < n; e += stride) dst[e] = from_f<D>(to_f(src[e]));
}

// Copies n activations from src to dst with every thread of the block, in 16-byte
// vectors when both pointers are 16-byte aligned (any n: the tail is copied one
// element at a time), otherwise element by element.
__device__ __forceinline__ void block_copy_act(act_t* dst, const act_t* src, long long n) {
    long long done = 0;
    if (aligned16(dst) && aligned16(src)) {
        const long long nv = n / 8;
        copy16_strided(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), nv, threadIdx.x,
                       blockDim.x);
        done = nv * 8;
    }
    for (long long e = done + threadIdx.x; e < n; e += blockDim.x) dst[e] = src[e];
}

// ---------------------------------------------------------------------------------
// Reductions. Warp versions need all 32 lanes active. Block versions need every thread
// of the block to call them, blockDim.x a multiple of 32 (at most 1024), and `scratch`
// pointing at 32 floats of shared memory. They return the result to every thread and
// end with a barrier, so the scratch can be reused right away.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    // Every warp reduces the per-warp partials itself: no second round trip.
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : neg_inf();
    t = warp_max(t);
    __syncthreads();
    return t;
}

// RMSNorm of one row by the whole CTA: out[c] = round(x[c] * rsqrt(mean(x^2) + eps) * w[c]),
// x and w read as fp32, every step in fp32, one rounding at the store. `out` may alias `x`:
// each element is read before the reduction's barrier and written after it by the thread
// that read it. 16-byte vectors when all the rows are aligned; the rest element-wise.
// `scratch`: 32 floats of shared memory. Every thread of the CTA must call it.
// `X`: act_t, or float for a row of the fp32 residual stream (then `out` cannot alias it).
// `copy` non-null: also copy[c] = (C) x[c] (bit exact when C is X, a NaN's payload included;
// one rounding into a 16-bit C from fp32), stored from the registers the norm loads x into. A separate copy loop before the norm
// costs the row its memory latency once more per iteration, since the norm's loads cannot
// be moved above the copy's stores (select_norm_pairs at B 1, perf-notes item 41). `copy`
// aliases none of x, out, lo.
// `add` non-null: the row normed (and copied) is x[c] + add[c], summed in fp32 and rounded
// once to X (exact for float), the same bits on every path; `add` aliases none of the outputs.
template <typename X>
__device__ __forceinline__ float row_sum_at(float v, const X* add, long long e) {
    return add != nullptr ? to_f(from_f<X>(v + to_f(add[e]))) : v;
}
template <typename X>
__device__ __forceinline__ void load_row8(const X* x, const X* add, long long e, float (&v)[8]) {
    load_vec<8>(x + e, v);
    if (add != nullptr) {
        float a[8];
        load_vec<8>(add + e, a);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = to_f(from_f<X>(v[k] + a[k]));
    }
}
template <typename X, typename C = act_t>
__device__ __forceinline__ void rmsnorm_row(const X* x, const act_t* w, act_t* out, long long n, float eps,
                                            float* scratch, act_t* lo = nullptr, C* copy = nullptr,
                                            const X* add = nullptr) {
    // lo non-null: the normed row as a hi/lo pair (store_vec_split), hi into out.
    // A 16-bit row copied into its own type keeps its bits (a NaN's payload too), not a
    // round trip through float; a sum is stored from its fp32 value (already rounded to X).
    constexpr bool kRawCopy = SameType<C, X>::value && sizeof(X) == 2;
    const bool raw = kRawCopy && add == nullptr;
    if (copy != nullptr && !aligned16(copy)) {
        // Never in a plan (its buffers are 256-byte aligned): the copy on its own, as the
        // kernels did before, so the norm keeps the path and the sums it has without one.
        if (add == nullptr) {
            parts_cast(copy, x, n, 0, 1);
        } else {
            for (long long e = threadIdx.x; e < n; e += blockDim.x) copy[e] = from_f<C>(row_sum_at(to_f(x[e]), add, e));
        }
        copy = nullptr;
    }
    const bool vec = aligned16(x) && aligned16(out) && aligned16(w) && (lo == nullptr || aligned16(lo)) &&
                     (add == nullptr || aligned16(add));
    const long long nv = vec ? (n / 8) * 8 : 0;
    constexpr int kRegVecs = 4;
    if (vec && nv == n && n <= 8LL * kRegVecs * blockDim.x) {
        // The row fits in registers (4 vectors a thread: H <= 8192 at 256 threads): x and w
        // are loaded together before the reduction, so the row costs one memory latency
        // instead of two. Same sums in the same order as the loop below: bit-identical.
        float v[kRegVecs][8], g[kRegVecs][8];
        uint4 bits[kRegVecs];  // raw: the row's own bits, for the copy
#pragma unroll
        for (int it = 0; it < kRegVecs; ++it) {
            const long long e = ((long long)threadIdx.x + (long long)it * blockDim.x) * 8;
            if (e < n) {
                if (raw) {
                    bits[it] = *reinterpret_cast<const uint4*>(x + e);
                    unpack8(bits[it], v[it]);  // what load_vec<8> does with an act_t row
                } else {
                    load_row8(x, add, e, v[it]);
                }
                load_vec<8>(w + e, g[it]);
            }
        }
        float ss = 0.0f;
#pragma unroll
        for (int it = 0; it < kRegVecs; ++it) {
            const long long e = ((long long)threadIdx.x + (long long)it * blockDim.x) * 8;
            if (e < n) {
                if (copy != nullptr) {
                    if (raw) {
                        *reinterpret_cast<uint4*>(copy + e) = bits[it];
                    } else {
                        store_vec<8>(copy + e, v[it]);
                    }
                }
#pragma unroll
                for (int k = 0; k < 8; ++k) ss += v[it][k] * v[it][k];
            }
        }
        ss = block_sum(ss, scratch);
        const float inv = rsqrtf(ss / (float)n + eps);
#pragma unroll
        for (int it = 0; it < kRegVecs; ++it) {
            const long long e = ((long long)threadIdx.x + (long long)it * blockDim.x) * 8;
            if (e < n) {
#pragma unroll
                for (int k = 0; k < 8; ++k) v[it][k] = v[it][k] * inv * g[it][k];
                if (lo != nullptr) {
                    store_vec_split<8>(out + e, lo + e, v[it]);
                } else {
                    store_vec<8>(out + e, v[it]);
                }
            }
        }
        return;
    }
    float ss = 0.0f;
    for (long long e = (long long)threadIdx.x * 8; e < nv; e += (long long)blockDim.x * 8) {
        float v[8];
        load_row8(x, add, e, v);
        if (copy != nullptr) {
            if (raw) {
                *reinterpret_cast<uint4*>(copy + e) = *reinterpret_cast<const uint4*>(x + e);
            } else {
                store_vec<8>(copy + e, v);
            }
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    }
    for (long long e = nv + threadIdx.x; e < n; e += blockDim.x) {
        const float v = row_sum_at(to_f(x[e]), add, e);
        if (copy != nullptr) {
            if (raw) {
                copy[e] = *reinterpret_cast<const C*>(x + e);
            } else {
                copy[e] = from_f<C>(v);
            }
        }
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)n + eps);
    for (long long e = (long long)threadIdx.x * 8; e < nv; e += (long long)blockDim.x * 8) {
        float v[8], g[8];
        load_row8(x, add, e, v);
        load_vec<8>(w + e, g);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = v[k] * inv * g[k];
        if (lo != nullptr) {
            store_vec_split<8>(out + e, lo + e, v);
        } else {
            store_vec<8>(out + e, v);
        }
    }
    for (long long e = nv + threadIdx.x; e < n; e += blockDim.x) {
        float y[1] = {row_sum_at(to_f(x[e]), add, e) * inv * to_f(w[e])};
        if (lo != nullptr) {
            store_vec_split<1>(out + e, lo + e, y);
        } else {
            out[e] = to_act(y[0]);
        }
    }
}

// ---------------------------------------------------------------------------------
// The K/V cache and page table the runtime registered (specplan_kernels::kv): read once
// per CTA from its device words. Element d of kv head g of token slot t of a layer's K (or
// V) pool is at kv_at(layout, t) + g * head_stride + d.
// ---------------------------------------------------------------------------------
struct KvLayout {
    long long mode;      // KV_MODE_TOKENS: entries are token slots; else page ids
    long long rows;      // request rows of the table
    long long cols;      // entries per row
    long long stride;    // int elements between rows of the table
    long long slots;     // token slots of the pool
    long long kv_stride; // act_t elements between consecutive token slots of a physical page
    long long page;      // slots per physical page (1: kv_stride apart throughout)
    long long page_stride; // act_t elements between physical pages
    long long head_stride; // act_t elements between the kv heads of a slot
};

__device__ __forceinline__ KvLayout kv_layout(const long long* w) {
    KvLayout l;
    l.mode = w[KV_WORD_MODE];
    l.rows = w[KV_WORD_TABLE_ROWS];
    l.cols = w[KV_WORD_TABLE_COLS];
    l.stride = w[KV_WORD_TABLE_STRIDE];
    l.slots = w[KV_WORD_SLOTS];
    l.kv_stride = w[KV_WORD_KV_STRIDE];
    l.page = w[KV_WORD_PHYS_PAGE];
    l.page_stride = w[KV_WORD_PAGE_STRIDE];
    l.head_stride = w[KV_WORD_HEAD_STRIDE];
    return l;
}

// Element offset of token slot t (kv head 0) in a layer's pool. Slots are < 2^31 and the
// page is uniform per launch, so the branch costs nothing and the division is 32-bit.
__device__ __forceinline__ long long kv_at(const KvLayout& l, long long t) {
    if (l.page == 1) return t * l.kv_stride;
    const unsigned ut = (unsigned)t, up = (unsigned)l.page;
    return (long long)(ut / up) * l.page_stride + (long long)(ut % up) * l.kv_stride;
}

// Request `req`'s table row, or null when `req` is not a row (no K/V: reads are zero,
// writes are skipped).
__device__ __forceinline__ const int* kv_row(const KvLayout& l, const int* table, long long req) {
    return (req >= 0 && req < l.rows) ? table + req * l.stride : nullptr;
}

// kv_token in two halves, so a caller can keep the table read in flight while it works
// and check the entry only when it needs the slot: kv_entry reads the table entry of `pos`
// (false: no entry to read — a null row, a position outside the row); kv_resolve turns
// the entry into the token slot, or -1 (a negative page, a slot outside [0, slots)).
__device__ __forceinline__ bool kv_entry(const KvLayout& l, const int* row, long long pos, long long page_size,
                                         int& entry) {
    entry = 0;
    if (row == nullptr || pos < 0) return false;
    const long long i = l.mode == KV_MODE_TOKENS ? pos : pos / page_size;
    if (i >= l.cols) return false;
    entry = row[i];
    return true;
}
__device__ __forceinline__ long long kv_resolve(const KvLayout& l, bool has, int entry, long long pos,
                                                long long page_size) {
    if (!has) return -1;
    long long t = entry;
    if (l.mode != KV_MODE_TOKENS) {
        if (entry < 0) return -1;
        t = (long long)entry * page_size + pos % page_size;
    }
    return (t >= 0 && t < l.slots) ? t : -1;
}

// The token slot of position `pos` in `row`, or -1 when there is none: a null row, a
// position outside the row, a negative page, or a slot outside [0, slots).
__device__ __forceinline__ long long kv_token(const KvLayout& l, const int* row, long long pos, long long page_size) {
    if (row == nullptr || pos < 0) return -1;
    long long t;
    if (l.mode == KV_MODE_TOKENS) {
        if (pos >= l.cols) return -1;
        t = row[pos];
    } else {
        const long long pi = pos / page_size;
        if (pi >= l.cols) return -1;
        const long long pg = row[pi];
        if (pg < 0) return -1;
        t = pg * page_size + pos % page_size;
    }
    return (t >= 0 && t < l.slots) ? t : -1;
}

// Draft decode's lanes (specplan_kernels::facts::lane_offset is the host's copy): lane k of
// a request with prefix L writes forward s's K/V at position L + lane_offset(L, k) + s, as
// SGLang 0.5.23 allocates them (srt/speculative/eagle_worker_common.py:275-333): lanes
// `steps` positions apart when a page holds one token or there is one lane; otherwise each
// lane's run starts a whole number of pages on, ceil((L % P + steps) / P) pages per lane.
__device__ __forceinline__ long long lane_offset(long long L, int lane, int steps, int lanes, long long page) {
    if (page == 1 || lanes == 1) return (long long)lane * steps;
    const long long run = (L % page + steps + page - 1) / page * page;
    return (long long)lane * run;
}

// ---------------------------------------------------------------------------------
// Device primitives of the attention's tile loader and split merge (PTX).
// ---------------------------------------------------------------------------------
// ---- cp.async (sm_80+): global -> shared copies that bypass registers -----------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned long long g = (unsigned long long)__cvta_generic_to_global(gmem);
    const unsigned bytes = valid ? 16u : 0u;  // 0 source bytes: the 16 bytes are zero-filled
    // No "memory" clobber here: it would stop the compiler from batching the page-table
    // loads of a tile ahead of the copies. Ordering against the shared memory reads is
    // given by cp_async_wait (which has the clobber) and the barriers after it.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// ---- Thread block clusters (sm_90+; attention.cu merges the splits of one request and kv
// head in one) ------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of every CTA of the cluster; the release / acquire pair orders the shared
// memory writes before it against the peers' reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The float at `p` (this CTA's shared memory) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned ra;
    float v;
    // No "memory" clobber: every read sits between the two cluster barriers (which have
    // it), and without it the compiler issues a row's 2 x csize reads back to back.
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(ra));
    return v;
}
#else
// Before sm_90 there are no clusters: every launch is a cluster of one.
__device__ __forceinline__ unsigned cluster_size() { return 1u; }
__device__ __forceinline__ unsigned cluster_rank() { return 0u; }
__device__ __forceinline__ void cluster_sync() {}
__device__ __forceinline__ float ld_cluster(const float* p, unsigned) { return *p; }
#endif

#endif  // SPECPLAN_COMMON_CUH
