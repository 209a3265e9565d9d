// attention.cu: causal (optionally sliding-window) attention of the N draft rows of each
// request over its paged KV cache, split along the keys (split-KV / flash-decoding),
// with GQA folding: one CTA serves all G = HEADS / KV_HEADS query heads of a kv head.
//
// ----------------------------------------------------------------------------------------
// Entry attn_partial
//   Constants: act_t, HEADS, KV_HEADS, HEAD_DIM, N, PAGE_SIZE, MAX_PAGES, SLOTS,
//              WINDOW (0 = no window), SCALE (1/sqrt(HEAD_DIM)), KV_TILE (64, 32 or 16)
//   Launch:    grid (batch, KV_HEADS, splits), block (128, 1, 1),
//              dynamic shared memory, in bytes, with ROWS = N * (HEADS / KV_HEADS):
//
//                ROWS*HEAD_DIM*4  +  2*KV_TILE*HEAD_DIM*sizeof(act_t)  +  ROWS*KV_TILE*4
//                (q rows, fp32)      (one K and one V tile)                (score tile, fp32)
//
//              (mirrored by specplan_kernels::geometry::attn_smem_bytes; no static
//              shared memory is used, so this is the CTA's whole footprint).
//   Params (by value, natural C alignment, fields in this order):
//     q           const act_t*  q of row r, head h at q[r*q_stride + h*HEAD_DIM + d]
//     k_cache     const act_t*  this layer's K pages [pages, PAGE_SIZE, KV_HEADS, HEAD_DIM]
//     v_cache     const act_t*  this layer's V pages, same layout
//     req_slots   const int*    [batch] page-table row of each request
//     page_table  const int*    [SLOTS, MAX_PAGES] pool page ids of each slot
//     prefix_lens const int*    [batch] (L: cached tokens before this step's N rows)
//     out         act_t*        [batch*N, HEADS*HEAD_DIM]      (written when gridDim.z == 1)
//     part_o      float*        [splits, batch*N, HEADS, HEAD_DIM] (written when gridDim.z > 1)
//     part_lse    float*        [splits, batch*N, HEADS]           (written when gridDim.z > 1)
//     batch       unsigned
//     splits      unsigned      number of KV splits (== gridDim.z)
//     q_stride    unsigned      elements between consecutive rows of q
//   Semantics. CTA (i, g, s): request i, kv head g, split s. Its query rows are
//   (j, hh) for j in [0, N), hh in [0, G): token row r = i*N + j, head h = g*G + hh.
//   L = prefix_lens[i], kv_len = L + N. Row j sees key positions p with
//   p <= L + j and, when WINDOW > 0, p > L + j - WINDOW.
//     kv_start = WINDOW > 0 ? max(0, L - WINDOW + 1) : 0,  total = kv_len - kv_start,
//     chunk    = ceil(total / splits) rounded up to a multiple of KV_TILE,
//     split s  = [kv_start + s*chunk, min(kv_len, kv_start + (s+1)*chunk))  (may be empty).
//   K/V of position p: page = page_table[req_slots[i]*MAX_PAGES + p/PAGE_SIZE],
//   slot = p % PAGE_SIZE, element ((page*PAGE_SIZE + slot)*KV_HEADS + g)*HEAD_DIM + d.
//   score = SCALE * dot(q, k) in fp32; online softmax in fp32 (max m, sum l, acc o).
//   gridDim.z == 1: out[r*HEADS*HEAD_DIM + h*HEAD_DIM + d] = round(o / l) (0 if no key).
//   gridDim.z  > 1: part_o[((s*rows + r)*HEADS + h)*HEAD_DIM + d] = o / l (0 if no key),
//                   part_lse[(s*rows + r)*HEADS + h] = m + logf(l) (-inf if no key),
//                   rows = batch*N.
//   Positions with a page index >= MAX_PAGES, a negative page entry, or a request whose
//   req_slots entry is outside [0, SLOTS) read as zero K/V: bad input never faults (the
//   host validates).
//
// ----------------------------------------------------------------------------------------
// Entry attn_merge
//   Constants: act_t, HEADS, HEAD_DIM (the others above are not needed)
//   Launch:    grid (rows, HEADS, 1), block (HEAD_DIM, 1, 1) with HEAD_DIM <= 256,
//              no dynamic shared memory.
//   Params (by value, natural C alignment, fields in this order):
//     part_o    const float*  [splits, rows, HEADS, HEAD_DIM]
//     part_lse  const float*  [splits, rows, HEADS]
//     out       act_t*        [rows, HEADS*HEAD_DIM]
//     rows      unsigned      batch*N
//     splits    unsigned
//   out = round(sum_s w_s*o_s / sum_s w_s), w_s = exp(lse_s - max_s lse_s), exact fp32
//   log-sum-exp merge; splits with lse = -inf weigh 0; 0 when every split is empty.
// ----------------------------------------------------------------------------------------
#include "common.cuh"

namespace attn {

constexpr float kScale = SCALE;

constexpr int kHeads = (int)HEADS;
constexpr int kD = (int)HEAD_DIM;
// Both entries are compiled from one source with every constant (one prelude per template),
// so these are always the instance's real values.
constexpr int kKvHeads = (int)KV_HEADS;
constexpr int kN = (int)N;
constexpr long long kPage = (long long)PAGE_SIZE;
constexpr long long kMaxPages = (long long)MAX_PAGES;
constexpr long long kSlots = (long long)SLOTS;
constexpr int kWindow = (int)WINDOW;
constexpr int kTile = (int)KV_TILE;

static_assert(kKvHeads > 0 && kHeads % kKvHeads == 0, "HEADS must be a multiple of KV_HEADS");
static_assert(kD % 8 == 0 && kD <= 256, "HEAD_DIM must be a multiple of 8, at most 256");
static_assert(kTile % 4 == 0 && (kTile >= 32 ? kTile % 32 == 0 : 32 % kTile == 0),
              "KV_TILE must divide 32 or be a multiple of 32 (and of 4)");
static_assert(kN > 0 && kPage > 0 && kMaxPages > 0 && kSlots > 0, "N, PAGE_SIZE, MAX_PAGES, SLOTS must be positive");

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kG = kHeads / kKvHeads;  // query heads per kv head
constexpr int kRows = kN * kG;         // query rows per CTA (GQA folding)

// Shared memory layout (bytes), matching the formula in the header comment:
constexpr long long kQBytes = (long long)kRows * kD * 4;       // sQ [kRows][kD] fp32
constexpr long long kKVBytes = (long long)kTile * kD * 2;      // sK, sV [kTile][kD] act_t (swizzled)
constexpr long long kPBytes = (long long)kRows * kTile * 4;    // sP [kRows][kTile] fp32
constexpr long long kSmemBytes = kQBytes + 2 * kKVBytes + kPBytes;
static_assert(sizeof(act_t) == 2, "act_t is a 16-bit type");
static_assert(kSmemBytes <= 227 * 1024, "attn_partial shared memory exceeds 227 KiB: use a smaller KV_TILE");

// K/V tiles are stored as rows of kChunks 16-byte chunks (8 elements). Chunk c of key t is
// stored at chunk position c ^ (t & kSwz). In the score phase the lanes of a warp read the
// same logical chunk of consecutive keys; without the XOR all of them would hit the same
// banks (a row is 128 or 256 bytes); with it, 8 consecutive keys cover 8 distinct 16-byte
// bank groups. Within one key the map is a permutation of chunks, so the P·V phase
// (lanes reading one key's row) stays conflict free too.
constexpr int kChunks = kD / 8;
constexpr int kSwz = (kChunks % 8 == 0) ? 7 : (kChunks % 4 == 0) ? 3 : (kChunks % 2 == 0) ? 1 : 0;

// Work split inside a warp. Warp w owns query rows [w*kRW, (w+1)*kRW) ∩ [0, kRows) for the
// whole CTA: it computes their scores, keeps their softmax state (m, l) and their output
// accumulators. Only that warp ever touches those rows of sP, so the score, softmax and
// P·V phases of a warp need no block barrier between them, just __syncwarp.
constexpr int kRW = (kRows + kWarps - 1) / kWarps;
// Score phase: lane = (row group rg, key lane kl); kl covers keys kl + kTL*k, k < kKPL;
// rg covers the warp's rows rg, rg + kRG, ... in passes of kRC rows (register tile
// kRC x kKPL per lane, q reads are warp broadcasts).
constexpr int kTL = kTile < 32 ? kTile : 32;
constexpr int kRG = 32 / kTL;
constexpr int kKPL = kTile / kTL;
constexpr int kRC = imin((kRW + kRG - 1) / kRG, 8);
// Softmax phase: lane holds scores lane + 32*k of one row, k < kST.
constexpr int kST = (kTile + 31) / 32;
// P·V phase: lane owns kDPL = ceil(HEAD_DIM/32) head dims of every row of its warp. When
// HEAD_DIM is 32, 64, 128 or 256 (kDPL in {1, 2, 4, 8}, dividing the 8-element chunk) they
// are contiguous and lie in one swizzled chunk: one 2/4/8/16-byte shared load per key.
// Otherwise (e.g. 96: 3 dims could straddle two chunks that the swizzle moves apart) they
// are strided by 32 and loaded one by one.
constexpr int kDPL = (kD + 31) / 32;
constexpr bool kDimsContig = kD % 32 == 0 && 8 % kDPL == 0;

// Occupancy hint for __launch_bounds__ (minimum CTAs per SM). Four CTAs leave 128
// registers per thread (65536 / (4 * 128)). That pays off only when their shared memory
// fits (228 KiB per SM, 1 KiB reserved per CTA) and the state held across the tile loop
// is small. kLiveState counts o (kRW*kDPL), m and l (2*kRW) and the score tile (kRC*kKPL).
// Otherwise no hint is given and ptxas picks the registers.
// Measured on H200, bf16, B=16, L=4000, 4 splits: with 32/8 heads, HEAD_DIM 128, N 8 and
// KV_TILE 64 (state 64, 32 bytes of spill) the hint cut 525 us to 387 us. With 28/4 heads
// (7 rows a warp for N=4, 14 for N=8) any cap below the natural 168-248 registers spilled
// and ran 5-60% slower (even at state 56), hence the conditions.
constexpr int kFitSmem = (int)((228LL * 1024) / (kSmemBytes + 1024));
constexpr int kLiveState = kRW * (kDPL + 2) + kRC * kKPL;
constexpr bool kEvenRows = kRows % kWarps == 0 && (kRW & (kRW - 1)) == 0;  // 1, 2, 4, 8... rows a warp
constexpr int kMinBlocks = (kFitSmem >= 4 && kEvenRows && kLiveState <= 64) ? 4 : 1;

__device__ __forceinline__ int dim_of(int lane, int e) { return kDimsContig ? lane * kDPL + e : lane + 32 * e; }

// Element index of (key t, dim d) in a swizzled K/V tile.
__device__ __forceinline__ int swz(int t, int d) { return t * kD + ((((d >> 3) ^ (t & kSwz))) << 3) + (d & 7); }

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

// Element offset of (position p, kv head g, d = 0) in the cache, or -1 when p is outside
// the split (p >= hi) or its page is out of range: such keys are zero-filled.
__device__ __forceinline__ long long key_offset(int p, int hi, const int* pt_row, int g) {
    if (p >= hi || pt_row == nullptr) return -1;
    const long long pidx = (long long)p / kPage;
    if (pidx >= kMaxPages) return -1;
    const int page = pt_row[pidx];
    if (page < 0) return -1;
    return (((long long)page * kPage + (long long)p % kPage) * kKvHeads + g) * kD;
}

// Issues the cp.async copies of one K or V tile (keys [tile0, tile0 + kTile)) into `dst`.
// Thread tid copies chunks tid + kThreads*it. All page-table lookups come first, so their
// global loads are in flight together; the copies follow.
constexpr int kLoadIters = (kTile * kChunks + kThreads - 1) / kThreads;
__device__ __forceinline__ void load_tile_async(act_t* dst, const act_t* cache, int tile0, int hi,
                                                const int* pt_row, int g) {
    long long off[kLoadIters];
#pragma unroll
    for (int it = 0; it < kLoadIters; ++it) {
        const int q = (int)threadIdx.x + it * kThreads;
        off[it] = q < kTile * kChunks ? key_offset(tile0 + q / kChunks, hi, pt_row, g) : -1;
    }
#pragma unroll
    for (int it = 0; it < kLoadIters; ++it) {
        const int q = (int)threadIdx.x + it * kThreads;
        if (q < kTile * kChunks) {
            const int t = q / kChunks, c = q % kChunks;
            const act_t* src = off[it] >= 0 ? cache + off[it] + c * 8 : cache;
            cp_async16(dst + t * kD + ((c ^ (t & kSwz)) << 3), src, off[it] >= 0);
        }
    }
}

// Loads the kDPL dims owned by `lane` of key t from a swizzled tile.
__device__ __forceinline__ void load_v_dims(const act_t* sV, int t, int lane, float (&v)[kDPL]) {
    if constexpr (kDimsContig) {
        // kDPL divides 8: the lane's dims are in one chunk, aligned to kDPL elements.
        load_vec<kDPL>(sV + swz(t, lane * kDPL), v);
    } else {
#pragma unroll
        for (int e = 0; e < kDPL; ++e) {
            const int d = lane + 32 * e;
            v[e] = d < kD ? to_f(sV[swz(t, d)]) : 0.0f;
        }
    }
}

}  // namespace attn

// AttnPartialParams is declared by the generated prelude, from specplan_kernels::params
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(128, attn::kMinBlocks) attn_partial(AttnPartialParams p) {
    using namespace attn;

    extern __shared__ __align__(16) unsigned char attn_smem[];
    float* sQ = reinterpret_cast<float*>(attn_smem);
    act_t* sK = reinterpret_cast<act_t*>(attn_smem + kQBytes);
    act_t* sV = reinterpret_cast<act_t*>(attn_smem + kQBytes + kKVBytes);
    float* sP = reinterpret_cast<float*>(attn_smem + kQBytes + 2 * kKVBytes);

    const int i = (int)blockIdx.x;  // request
    const int g = (int)blockIdx.y;  // kv head
    const int s = (int)blockIdx.z;  // KV split
    const unsigned splits = p.splits > 0u ? p.splits : 1u;
    // Uniform per CTA, before any barrier.
    if ((unsigned)i >= p.batch || g >= kKvHeads || (unsigned)s >= splits) return;

    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // This request's page-table row (null: a bad slot, every key then reads as zero).
    const int req_slot = p.req_slots[i];
    const int* pt_row = (req_slot >= 0 && req_slot < kSlots) ? p.page_table + (long long)req_slot * kMaxPages : nullptr;

    // ---- This split's key range ----------------------------------------------------------
    const int L = p.prefix_lens[i];
    const long long kv_len = (long long)L + kN;
    long long kv_start = 0;
    if (kWindow > 0) {
        kv_start = (long long)L - kWindow + 1;
        if (kv_start < 0) kv_start = 0;
    }
    long long total = kv_len - kv_start;
    if (total < 0) total = 0;
    const long long chunk = ceil_div(ceil_div(total, (long long)splits), kTile) * kTile;
    const long long lo_ll = kv_start + (long long)s * chunk;
    long long hi_ll = lo_ll + chunk;
    if (hi_ll > kv_len) hi_ll = kv_len;
    const int lo = (int)lo_ll;
    const int hi = hi_ll > lo_ll ? (int)hi_ll : lo;
    const int num_tiles = (int)ceil_div(hi - lo, kTile);

    // ---- q rows -> sQ (fp32), row rr = j*G + hh ------------------------------------------
    {
        const act_t* qbase = p.q + (long long)i * kN * p.q_stride + (long long)g * kG * kD;
        if (aligned16(p.q) && p.q_stride % 8u == 0u) {
            for (int v = tid; v < kRows * kChunks; v += kThreads) {
                const int rr = v / kChunks, d = (v % kChunks) * 8;
                const int j = rr / kG, hh = rr % kG;
                float f[8];
                load_vec<8>(qbase + (long long)j * p.q_stride + (long long)hh * kD + d, f);
                float4* dst = reinterpret_cast<float4*>(sQ + rr * kD + d);
                dst[0] = make_float4(f[0], f[1], f[2], f[3]);
                dst[1] = make_float4(f[4], f[5], f[6], f[7]);
            }
        } else {
            for (int e = tid; e < kRows * kD; e += kThreads) {
                const int rr = e / kD, d = e % kD;
                const int j = rr / kG, hh = rr % kG;
                sQ[e] = to_f(qbase[(long long)j * p.q_stride + (long long)hh * kD + d]);
            }
        }
    }

    // ---- Per-warp state: rows w*kRW + x, x < kRW (rows >= kRows are padding) -------------
    const int row0 = warp * kRW;
    float m[kRW], l[kRW], o[kRW][kDPL];
#pragma unroll
    for (int x = 0; x < kRW; ++x) {
        m[x] = neg_inf();
        l[x] = 0.0f;
#pragma unroll
        for (int e = 0; e < kDPL; ++e) o[x][e] = 0.0f;
    }
    const int kl = lane % kTL, rg = lane / kTL;  // score-phase lane coordinates

    // ---- Main loop over KV tiles -----------------------------------------------------------
    // Pipeline (cp.async groups, at most two in flight):
    //   K(t) is issued before the previous tile's P·V; V(t) at the top of iteration t, so
    //   V(t) streams in during the score phase of tile t and K(t+1) during its P·V phase.
    if (num_tiles > 0) {
        load_tile_async(sK, p.k_cache, lo, hi, pt_row, g);
        cp_async_commit();
    }
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int tile0 = lo + tile * kTile;
        load_tile_async(sV, p.v_cache, tile0, hi, pt_row, g);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's K(tile) copies have landed ...
        __syncthreads();     // ... and everyone's (also publishes sQ on the first tile)

        // -- Scores: sP[rr][t] = SCALE * q[rr]·k[t], or -inf where masked -----------------
#pragma unroll
        for (int x0 = 0; x0 < kRW; x0 += kRC * kRG) {
            int qrow[kRC];  // sQ row per register-tile row (clamped: padding rows compute junk)
#pragma unroll
            for (int y = 0; y < kRC; ++y) qrow[y] = imin(row0 + imin(x0 + rg + kRG * y, kRW - 1), kRows - 1);
            float acc[kRC][kKPL];
#pragma unroll
            for (int y = 0; y < kRC; ++y)
#pragma unroll
                for (int k = 0; k < kKPL; ++k) acc[y][k] = 0.0f;

#pragma unroll 2
            for (int c = 0; c < kChunks; ++c) {
                float kf[kKPL][8];
#pragma unroll
                for (int k = 0; k < kKPL; ++k) {
                    const int t = kl + kTL * k;
                    load_vec<8>(sK + t * kD + ((c ^ (t & kSwz)) << 3), kf[k]);
                }
#pragma unroll
                for (int y = 0; y < kRC; ++y) {
                    const float4* q4 = reinterpret_cast<const float4*>(sQ + qrow[y] * kD + c * 8);
                    const float4 a = q4[0], b = q4[1];
#pragma unroll
                    for (int k = 0; k < kKPL; ++k) {
                        float sacc = acc[y][k];
                        sacc = fmaf(a.x, kf[k][0], sacc);
                        sacc = fmaf(a.y, kf[k][1], sacc);
                        sacc = fmaf(a.z, kf[k][2], sacc);
                        sacc = fmaf(a.w, kf[k][3], sacc);
                        sacc = fmaf(b.x, kf[k][4], sacc);
                        sacc = fmaf(b.y, kf[k][5], sacc);
                        sacc = fmaf(b.z, kf[k][6], sacc);
                        sacc = fmaf(b.w, kf[k][7], sacc);
                        acc[y][k] = sacc;
                    }
                }
            }
#pragma unroll
            for (int y = 0; y < kRC; ++y) {
                const int x = x0 + rg + kRG * y;
                const int rr = row0 + x;
                if (x < kRW && rr < kRows) {
                    const int qpos = L + rr / kG;  // causal limit of row j = rr / G
#pragma unroll
                    for (int k = 0; k < kKPL; ++k) {
                        const int t = kl + kTL * k;
                        const int kp = tile0 + t;
                        const bool visible = kp < hi && kp <= qpos && (kWindow == 0 || kp + kWindow > qpos);
                        sP[rr * kTile + t] = visible ? kScale * acc[y][k] : neg_inf();
                    }
                }
            }
        }
        __syncwarp();

        // -- Online softmax, one row at a time over the warp -----------------------------
#pragma unroll
        for (int x = 0; x < kRW; ++x) {
            const int rr = row0 + x;
            if (rr < kRows) {  // warp uniform
                float sv[kST];
                float tmax = neg_inf();
#pragma unroll
                for (int k = 0; k < kST; ++k) {
                    const int t = lane + 32 * k;
                    sv[k] = t < kTile ? sP[rr * kTile + t] : neg_inf();
                    tmax = fmaxf(tmax, sv[k]);
                }
                tmax = warp_max(tmax);
                const float m_new = fmaxf(m[x], tmax);
                // Guards: while a row has seen no visible key m is -inf and l, o are 0;
                // exp(-inf - -inf) would be NaN, so such factors are forced to 0.
                const float alpha = m[x] == neg_inf() ? 0.0f : expf(m[x] - m_new);
                float psum = 0.0f;
#pragma unroll
                for (int k = 0; k < kST; ++k) {
                    const int t = lane + 32 * k;
                    const float pk = m_new == neg_inf() ? 0.0f : expf(sv[k] - m_new);  // masked: exp(-inf) = 0
                    if (t < kTile) sP[rr * kTile + t] = pk;
                    psum += pk;
                }
                psum = warp_sum(psum);
                l[x] = l[x] * alpha + psum;
                m[x] = m_new;
#pragma unroll
                for (int e = 0; e < kDPL; ++e) o[x][e] *= alpha;
            }
        }

        cp_async_wait<0>();  // this thread's V(tile) copies have landed ...
        __syncthreads();     // ... and everyone's; every warp is also done reading sK
        if (tile + 1 < num_tiles) {
            load_tile_async(sK, p.k_cache, tile0 + kTile, hi, pt_row, g);
            cp_async_commit();
        }

        // -- o[rr] += sum_t P[rr][t] * V[t] ------------------------------------------------
        // (sP rows of this warp were written by this warp; the barrier above ordered them.)
#pragma unroll 2
        for (int t = 0; t < kTile; t += 4) {
            float v0[kDPL], v1[kDPL], v2[kDPL], v3[kDPL];
            load_v_dims(sV, t + 0, lane, v0);
            load_v_dims(sV, t + 1, lane, v1);
            load_v_dims(sV, t + 2, lane, v2);
            load_v_dims(sV, t + 3, lane, v3);
#pragma unroll
            for (int x = 0; x < kRW; ++x) {
                const int rr = row0 + x;
                if (rr < kRows) {
                    const float4 pp = *reinterpret_cast<const float4*>(sP + rr * kTile + t);
#pragma unroll
                    for (int e = 0; e < kDPL; ++e) {
                        float acc = o[x][e];
                        acc = fmaf(pp.x, v0[e], acc);
                        acc = fmaf(pp.y, v1[e], acc);
                        acc = fmaf(pp.z, v2[e], acc);
                        acc = fmaf(pp.w, v3[e], acc);
                        o[x][e] = acc;
                    }
                }
            }
        }
        __syncthreads();  // every warp is done reading sV before V(tile+1) is issued
    }

    // ---- Epilogue ------------------------------------------------------------------------
    const long long rows = (long long)p.batch * kN;
    const bool single = gridDim.z == 1u;
    if (single ? p.out == nullptr : (p.part_o == nullptr || p.part_lse == nullptr)) return;
#pragma unroll
    for (int x = 0; x < kRW; ++x) {
        const int rr = row0 + x;
        if (rr < kRows) {
            const int j = rr / kG, hh = rr % kG;
            const long long r = (long long)i * kN + j;
            const int h = g * kG + hh;
            const bool any = l[x] > 0.0f;
            if (single) {
                act_t* dst = p.out + r * ((long long)kHeads * kD) + (long long)h * kD;
#pragma unroll
                for (int e = 0; e < kDPL; ++e) {
                    const int d = dim_of(lane, e);
                    if (d < kD) dst[d] = to_act(any ? o[x][e] / l[x] : 0.0f);
                }
            } else {
                const long long sr = ((long long)s * rows + r) * kHeads + h;
                float* dst = p.part_o + sr * kD;
#pragma unroll
                for (int e = 0; e < kDPL; ++e) {
                    const int d = dim_of(lane, e);
                    if (d < kD) dst[d] = any ? o[x][e] / l[x] : 0.0f;
                }
                if (lane == 0) p.part_lse[sr] = any ? m[x] + logf(l[x]) : neg_inf();
            }
        }
    }
}

// AttnMergeParams is declared by the generated prelude, from specplan_kernels::params
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(256) attn_merge(AttnMergeParams p) {
    constexpr long long kH = (long long)HEADS;
    constexpr long long kHD = (long long)HEAD_DIM;
    const unsigned r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (r >= p.rows || h >= HEADS || d >= HEAD_DIM) return;

    const long long rows = p.rows;
    float mx = neg_inf();
    for (unsigned s = 0; s < p.splits; ++s) mx = fmaxf(mx, p.part_lse[((long long)s * rows + r) * kH + h]);

    float num = 0.0f, den = 0.0f;
    if (mx != neg_inf()) {
        for (unsigned s = 0; s < p.splits; ++s) {
            const long long sr = ((long long)s * rows + r) * kH + h;
            const float lse = p.part_lse[sr];
            if (lse != neg_inf()) {  // an empty split weighs 0 (and its o is 0 anyway)
                const float w = expf(lse - mx);
                den += w;
                num = fmaf(w, p.part_o[sr * kHD + d], num);
            }
        }
    }
    p.out[(long long)r * (kH * kHD) + (long long)h * kHD + d] = to_act(den > 0.0f ? num / den : 0.0f);
}
