// rope_append.cu: rotary position embedding of q and k, and the append of k and v to the
// paged KV cache of this layer.
//
// Row r of qkv (request i = r / N, draft slot j = r % N) holds, in act_t,
//   [ q heads (HEADS*HEAD_DIM) | k heads (KV_HEADS*HEAD_DIM) | v heads (KV_HEADS*HEAD_DIM) ].
// Its position is pos = prefix_lens[i] + j, and its K/V go to position pos. Draft decode
// (LANE_STEPS = S > 0; N = topk, j the lane): every row of forward STEP is at
// pos = prefix_lens[i] + STEP and writes position L + lane_offset(L, j) + STEP (common.cuh). Rotate-half RoPE (Hugging Face Llama), with
// D = HEAD_DIM, for d in [0, D/2):
//   angle = float(pos) * INV_FREQ[d]     (one fp32 multiply)
//   c = cosf(angle), s = sinf(angle)     (accurate library versions, not __cosf/__sinf)
//   y[d]       = x[d] * c - x[d + D/2] * s
//   y[d + D/2] = x[d + D/2] * c + x[d] * s
// in fp32, rounded once to act_t.
//   * q heads are rotated in place in qkv;
//   * k heads are rotated and written to k_cache (qkv's k part is left as it was);
//   * v heads are copied, bit exact, to v_cache.
// Request i owns row req_slots[i] of the registered page table; position pos has the
// token slot t = kv_token(layout, row, pos, PAGE_SIZE) (common.cuh: a token-slot entry, or
// page * PAGE_SIZE + pos % PAGE_SIZE) and its K is at k_cache + kv_at(layout, t), element
// kvh*head_stride + d (V likewise; common.cuh). When t is -1 (a request row outside the table, -1 for a
// padded or refused request, a position outside the row, a negative page, a slot outside
// the pool) the cache write is skipped: bad input never faults. q is rotated in every case.
//
// Entry:     rope_append
// Constants: act_t, HEADS, KV_HEADS, HEAD_DIM, N, PAGE_SIZE, LANE_STEPS, STEP, INV_FREQ[HEAD_DIM/2], ROPE_SCALE
//            (YaRN's and LongRoPE's attention factor, 1 otherwise: cos and sin are scaled by it, so the
//            rotated q and the cached k are, as SGLang's YaRN cos/sin cache has it)
// Launch:    grid (rows, parts, 1), block (ROPE_APPEND_THREADS = 128, 1, 1), no dynamic shared memory
//            (HEAD_DIM * 4 bytes of static shared memory: the row's cos/sin table);
//            parts = kernels::facts::row_parts (at most 8, 1 from 256 rows): CTA (r, y)
//            takes every parts-th 128-unit slice of row r's rotations and V copies (each
//            computes the row's table and slot).
// Params (by value, natural C alignment, fields in this order):
//   qkv          act_t*      [rows, (HEADS + 2*KV_HEADS)*HEAD_DIM], q part rotated in place
//   prefix_lens  const int*  [batch]              tokens already cached per request
//   req_slots    const int*  [batch]              page-table row of each request
//   page_table   const int*  the registered page table (token slots or page ids)
//   kv_layout    const long long*  its words and the pool's (specplan_kernels::kv)
//   k_cache      act_t*      this layer's K pool
//   v_cache      act_t*      this layer's V pool
//   rows         unsigned    batch*N; CTAs with blockIdx.x >= rows do nothing
#include "common.cuh"

// RopeAppendParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

namespace rope {

constexpr int kD = (int)HEAD_DIM;
constexpr int kHalf = kD / 2;
constexpr int kHeads = (int)HEADS;
constexpr int kKvHeads = (int)KV_HEADS;
constexpr long long kRowElems = (long long)(kHeads + 2 * kKvHeads) * kD;
static_assert(kD % 2 == 0, "rotate-half RoPE needs an even HEAD_DIM");

// Rotates V consecutive pairs (x1 = src1[0..V), x2 = src2[0..V)) whose first index in the
// half head is d0, and stores them to dst1 / dst2 (which may equal src1 / src2).
template <int V>
__device__ __forceinline__ void rotate(const float (&x1)[V], const float (&x2)[V], act_t* dst1, act_t* dst2,
                                       int d0, const float* cs, const float* sn) {
    float y1[V], y2[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const float c = cs[d0 + k], s = sn[d0 + k];
        y1[k] = x1[k] * c - x2[k] * s;
        y2[k] = x2[k] * c + x1[k] * s;
    }
    store_vec<V>(dst1, y1);
    store_vec<V>(dst2, y2);
}

// The whole row with V-element units (V = 8: 16-byte accesses; V = 1: scalar).
// `kbase` is the element offset of (slot, kvh = 0) in the caches, or -1 to skip; kv heads
// are `hs` elements apart.
constexpr long long kVElems = (long long)kKvHeads * kD;  // v heads: contiguous in qkv

// The raw bits of this thread's first rotation unit (its two halves) and first V vector in
// the 8-element path. They depend only on the row, so the kernel loads them before the
// position's page-table chain and the barrier: the row's load then overlaps those reads
// instead of following them (perf-notes item 44).
struct First {
    uint4 x1, x2, v;
};

__device__ __forceinline__ First first_loads(const act_t* qkv_row) {
    constexpr int kUnitsPerHead = kHalf / 8;
    constexpr int kRotUnits = (kHeads + kKvHeads) * kUnitsPerHead;
    const int t = (int)(blockIdx.y * blockDim.x + threadIdx.x);
    First f = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (t < kRotUnits) {
        const act_t* src = qkv_row + (long long)(t / kUnitsPerHead) * kD + (t % kUnitsPerHead) * 8;
        f.x1 = *reinterpret_cast<const uint4*>(src);
        f.x2 = *reinterpret_cast<const uint4*>(src + kHalf);
    }
    if ((long long)t * 8 < kVElems) {
        f.v = *reinterpret_cast<const uint4*>(qkv_row + (long long)(kHeads + kKvHeads) * kD + (long long)t * 8);
    }
    return f;
}

// FIRST (V = 8 only): the thread's first unit and V vector come from `first` (first_loads),
// the rest from memory.
template <int V, bool FIRST>
__device__ __forceinline__ void row(act_t* qkv_row, act_t* k_cache, act_t* v_cache, long long kbase,
                                    long long hs, const float* cs, const float* sn, const First& first) {
    static_assert(!FIRST || V == 8, "first_loads holds 8-element vectors");
    constexpr int kUnitsPerHead = kHalf / V;  // rotation units per head
    constexpr int kRotUnits = (kHeads + kKvHeads) * kUnitsPerHead;
    const int t = (int)(blockIdx.y * blockDim.x + threadIdx.x), stride = (int)(blockDim.x * gridDim.y);
    for (int u = t; u < kRotUnits; u += stride) {
        const int head = u / kUnitsPerHead;  // 0..HEADS-1: q, then HEADS..: k
        const int d0 = (u % kUnitsPerHead) * V;
        const act_t* src = qkv_row + (long long)head * kD + d0;
        float x1[V], x2[V];
        bool loaded = false;
        if constexpr (FIRST) {
            if (u == t) {
                unpack8(first.x1, x1);
                unpack8(first.x2, x2);
                loaded = true;
            }
        }
        if (!loaded) {
            load_vec<V>(src, x1);
            load_vec<V>(src + kHalf, x2);
        }
        if (head < kHeads) {
            act_t* dst = qkv_row + (long long)head * kD + d0;
            rotate<V>(x1, x2, dst, dst + kHalf, d0, cs, sn);
        } else if (kbase >= 0) {
            act_t* dst = k_cache + kbase + (long long)(head - kHeads) * hs + d0;
            rotate<V>(x1, x2, dst, dst + kHalf, d0, cs, sn);
        }
    }
    if (kbase < 0) return;
    // v heads: KV_HEADS*HEAD_DIM contiguous elements in qkv, heads `hs` apart in the cache.
    const act_t* vsrc = qkv_row + (long long)(kHeads + kKvHeads) * kD;
    for (long long e = (long long)t * V; e < kVElems; e += (long long)stride * V) {
        act_t* dst = v_cache + kbase + (e / kD) * hs + e % kD;
        bool copied = false;
        if constexpr (FIRST) {
            if (e == (long long)t * V) {
                *reinterpret_cast<uint4*>(dst) = first.v;  // bit exact, as copy_vec<8>
                copied = true;
            }
        }
        if (!copied) copy_vec<V>(dst, vsrc + e);
    }
}

}  // namespace rope

extern "C" __global__ void __launch_bounds__(ROPE_APPEND_THREADS) rope_append(RopeAppendParams p) {
    __shared__ float cs[rope::kHalf > 0 ? rope::kHalf : 1];
    __shared__ float sn[rope::kHalf > 0 ? rope::kHalf : 1];
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;  // uniform per CTA
    act_t* qkv_row = p.qkv + (long long)r * rope::kRowElems;
    // The 8-element path's first loads, issued before anything they do not depend on.
    constexpr bool kVec = rope::kHalf % 8 == 0;
    rope::First first = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (kVec && aligned16(p.qkv)) first = rope::first_loads(qkv_row);
    const int i = (int)(r / N);
    const int j = (int)(r % N);
    const int L = p.prefix_lens[i];
    // Draft-extend: row j at L + j. Draft decode: every lane at L + STEP, its K/V in the
    // lane's own slot (common.cuh lane_offset).
    const int pos = LANE_STEPS > 0 ? L + (int)STEP : L + j;
    const long long wpos =
        LANE_STEPS > 0 ? (long long)L + lane_offset(L, j, (int)LANE_STEPS, (int)N, (long long)PAGE_SIZE) + STEP : pos;

    // cos/sin of this row's position, once per CTA (the accurate cosf/sinf are costly and
    // the same angles serve every head).
    for (int d = threadIdx.x; d < rope::kHalf; d += blockDim.x) {
        const float angle = (float)pos * INV_FREQ[d];
        cs[d] = cosf(angle) * ROPE_SCALE;
        sn[d] = sinf(angle) * ROPE_SCALE;
    }

    // Cache element of this position's token slot (or -1: skip the write).
    const KvLayout lay = kv_layout(p.kv_layout);
    const long long tok = kv_token(lay, kv_row(lay, p.page_table, p.req_slots[i]), wpos, (long long)PAGE_SIZE);
    const long long kbase = tok < 0 ? -1 : kv_at(lay, tok);
    __syncthreads();

    // Vector path: half heads are whole 8-element units and every row/head/cache start is
    // 16-byte aligned (HEAD_DIM % 16 == 0 makes all offsets multiples of 8 elements; the
    // runtime registers pools whose strides are multiples of 8 elements).
    if (rope::kHalf % 8 == 0 && aligned16(p.qkv) && aligned16(p.k_cache) && aligned16(p.v_cache) &&
        lay.kv_stride % 8 == 0 && lay.page_stride % 8 == 0 && lay.head_stride % 8 == 0) {
        rope::row<kVec ? 8 : 1, kVec>(qkv_row, p.k_cache, p.v_cache, kbase, lay.head_stride, cs, sn, first);
    } else {
        rope::row<1, false>(qkv_row, p.k_cache, p.v_cache, kbase, lay.head_stride, cs, sn, first);
    }
}
