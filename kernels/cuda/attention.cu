// attention.cu: causal (optionally sliding-window) attention of the N draft rows of each
// request over its paged KV cache, split along the keys (split-KV / flash-decoding),
// with GQA folding: one CTA serves all G = HEADS / KV_HEADS query heads of a kv head, so
// the N·G "packed rows" share every K/V byte it loads. QKᵀ and P·V run on tensor cores
// (mma.sync m16n8k16, fp32 accumulation); softmax statistics stay in fp32.
//
// ----------------------------------------------------------------------------------------
// Entry attn_partial
//   Constants: act_t, HEADS, KV_HEADS, HEAD_DIM (multiple of 16, <= 256), N, PAGE_SIZE, LANE_STEPS, STEP,
//              WINDOW (0 = no window), SCALE (1/sqrt(HEAD_DIM)),
//              KV_TILE (keys per pipeline stage: 64, 32 or 16), STAGES (2..4: tiles in
//              shared memory, STAGES - 1 of them in flight while one is computed),
//              SELECT_FROM (0, or the N of the selected-query instance: see below)
//   Launch:    grid (batch, KV_HEADS, splits), optionally as clusters (1, 1, splits) (sm_90+,
//              splits <= 16: the plan's `attn_cluster`), block (ATTN_PARTIAL_THREADS = 128, 1, 1), dynamic shared memory,
//              in bytes, with ROWS = N * (HEADS / KV_HEADS), GR = min(ceil16(ROWS), 64)
//              (packed rows per pass) and a = sizeof(act_t):
//
//                GR*HEAD_DIM*a  +  max(STAGES*2*KV_TILE*HEAD_DIM*a,  4*16*HEAD_DIM*4 + 4*16*2*4
//                                                                     + GR*HEAD_DIM*4 + GR*4)
//                (q rows)           (K and V tiles of each stage)  (cross-warp merge, then the
//                                                                   cluster merge's rows; aliased)
//                +  STAGES*KV_TILE*4
//                   (each key's offset in the pool, head included, in 16-byte units, of the
//                   tiles in flight; kStages - 1 rows are in use at a time, one more keeps
//                   the row indexing a plain modulo)
//
//              (mirrored by specplan_kernels::facts::attn_smem_bytes; no static
//              shared memory is used, so this is the CTA's whole footprint).
//   Params (by value, natural C alignment, fields in this order):
//     q           const act_t*  q of row r, head h at q[r*q_stride + h*HEAD_DIM + d]
//     k_cache     const act_t*  this layer's K pool (token slot t at kv_at(layout, t))
//     v_cache     const act_t*  this layer's V pool, same layout
//     req_slots   const int*    [batch] page-table row of each request (-1: none)
//     page_table  const int*    the registered table (token slots or page ids)
//     kv_layout   const long long*  its words and the pool's (specplan_kernels::kv)
//     prefix_lens const int*    [batch] (L: cached tokens before this step's N rows)
//     accept_lens const int*    [batch] (SELECT_FROM > 0: A_i; else null)
//     out         act_t*        [batch*N, HEADS*HEAD_DIM]      (written when gridDim.z == 1)
//     part_o      float*        [splits, batch*N, HEADS, HEAD_DIM] (written when gridDim.z > 1)
//     part_lse    float*        [splits, batch*N, HEADS]           (written when gridDim.z > 1)
//     batch       unsigned
//     splits      unsigned      number of KV splits (== gridDim.z)
//     q_stride    unsigned      elements between consecutive rows of q
//     cluster     unsigned      splits when launched as clusters (1, 1, splits) that merge, else 1
//   Semantics. CTA (i, g, s): request i, kv head g, split s. Its query rows are
//   (j, hh) for j in [0, N), hh in [0, G): token row r = i*N + j, head h = g*G + hh.
//   L = prefix_lens[i], kv_len = L + N. Row j sees key positions p with
//   p <= L + j and, when WINDOW > 0, p > L + j - WINDOW.
//     kv_start = WINDOW > 0 ? max(0, L - WINDOW + 1) : 0,  total = kv_len - kv_start,
//     chunk    = ceil(total / splits) rounded up to a multiple of KV_TILE,
//     split s  = [kv_start + s*chunk, min(kv_len, kv_start + (s+1)*chunk))  (may be empty).
//   K/V of position p: token slot t = kv_token(layout, row of req_slots[i], p, PAGE_SIZE)
//   (common.cuh), element kv_at(layout, t) + g*head_stride + d.
//   score = SCALE * dot(q, k) (bf16/fp16 products, fp32 sums); online softmax in fp32
//   (max m, sum l, acc o); the probabilities are rounded to act_t for the P·V product.
//   gridDim.z == 1: out[r*HEADS*HEAD_DIM + h*HEAD_DIM + d] = round(o / l) (0 if no key;
//                   o / l as o * (1 / l), within an ulp),
//   gridDim.z  > 1: part_o[((s*rows + r)*HEADS + h)*HEAD_DIM + d] = o / l (0 if no key;
//                   also as o * (1 / l)),
//                   part_lse[(s*rows + r)*HEADS + h] = m + logf(l) (-inf if no key),
//                   rows = batch*N;
//                   as clusters of the splits: out as with gridDim.z == 1, the splits'
//                   results merged exactly as attn_merge does (part_o, part_lse unused).
//   Draft decode (LANE_STEPS = S > 0, N = topk, row j = lane j, STEP = the forward):
//   kv_len = L + N*(STEP+1); key index t < L is position t, t >= L is lane
//   u = (t-L)/(STEP+1)'s slot position L + lane_offset(L, u) + (t-L)%(STEP+1) (common.cuh);
//   row j sees every t < L and the keys of lane j; with a window, a key at sequence position
//   q (t < L: t; a lane key: L + (t-L)%(STEP+1)) is seen when q > L + STEP - WINDOW, and
//   kv_start = min(L, max(0, L + STEP - WINDOW + 1)).
//   Selected queries (SELECT_FROM = S > 0, N = 1, no lanes): request i's one row is q row
//   i*S + sel, sel = clamp(accept_lens[i], 1, S) - 1, at position L + sel: everything above
//   holds with N = 1 and L replaced by L + sel (q has S rows a request; out and the partials
//   have one, row i). The draft-extend head's last layer keeps no other row's output.
//   Positions without a token slot (t = -1: a request row outside the table, a position
//   outside the row, a negative page, a slot outside the pool) read as zero K/V: bad input
//   never faults.
//
// ----------------------------------------------------------------------------------------
// Entry attn_merge
//   Constants: act_t, HEADS, HEAD_DIM (the others above are not needed)
//   Launch:    grid (rows, HEADS, 1), block (ATTN_MERGE_THREADS = HEAD_DIM, 1, 1) with HEAD_DIM <= 256,
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
// Entry attn_fused (attn_partial's splits and attn_merge's merge in one launch, for
//            instances of ROWS <= 16: specplan_kernels ATTN_LAST_CTA_ROWS)
//   Constants, launch (never as clusters), shared memory: attn_partial's.
//   Params (by value, natural C alignment, fields in this order): attn_partial's q .. part_lse,
//     then counters unsigned* [batch*KV_HEADS] (the runtime's arrival counters: 0 before the
//     launch, and 0 again after it), batch, splits, q_stride (no cluster).
//   Semantics: every CTA computes and writes its split's partials as attn_partial does with
//   gridDim.z > 1; the last CTA of each (request, kv head) to finish then writes that group's
//   rows of out exactly as attn_merge computes them from all the splits' partials. With one
//   split: attn_partial's gridDim.z == 1 (out directly, nothing counted; counters must still
//   be given).
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
constexpr int kWindow = (int)WINDOW;
constexpr int kTile = (int)KV_TILE;
// Draft decode (LANE_STEPS = S > 0): the N rows of a request are its lanes; forward STEP's
// keys are the prefix [0, L) followed by each lane's STEP + 1 slots, lane after lane (key
// index t >= L: lane (t - L) / kLaneKeys, its (t - L) % kLaneKeys-th slot); a row sees the
// prefix and its own lane's keys. Draft-extend: key index = position, causal rows.
constexpr bool kLanes = (int)LANE_STEPS > 0;
constexpr int kLaneKeys = (int)STEP + 1;
// SELECT_FROM = N > 0: the instance runs over the selected query row of each request (N is
// then 1 here; `sel` in attn_partial): q holds SELECT_FROM rows per request. 0: every row.
constexpr int kSelectFrom = (int)SELECT_FROM;
constexpr int kQRowsPerRequest = kSelectFrom > 0 ? kSelectFrom : kN;
static_assert(kSelectFrom == 0 || (kN == 1 && !kLanes), "selected queries: one row a request, draft-extend rows");
// The largest prefix read as given: the keys past it (kN * kLaneKeys) and a split's end
// rounded up to whole tiles stay below 2^31.
constexpr int kMaxPrefix = 0x7fffffff - kN * kLaneKeys - 2 * kTile;

static_assert(kKvHeads > 0 && kHeads % kKvHeads == 0, "HEADS must be a multiple of KV_HEADS");
static_assert(kD % 16 == 0 && kD <= 256, "HEAD_DIM must be a multiple of 16, at most 256 (MMA k-steps)");
static_assert(kTile == 16 || kTile == 32 || kTile == 64, "KV_TILE must be 16, 32 or 64");
static_assert(kN > 0 && kPage > 0, "N and PAGE_SIZE must be positive");
static_assert(sizeof(act_t) == 2, "act_t is a 16-bit type");

constexpr int kThreads = (int)ATTN_PARTIAL_THREADS;
static_assert(kThreads % 32 == 0, "attn_partial runs whole warps");
constexpr int kWarps = kThreads / 32;
constexpr int kG = kHeads / kKvHeads;  // query heads per kv head
constexpr int kRows = kN * kG;         // packed query rows per CTA (GQA folding)

// Row passes. A warp owns one 16-row MMA tile; a pass covers up to 4 of them (64 packed
// rows). Larger N·G runs several passes over the same keys (the K/V bytes are then read
// again, mostly from L2), which keeps the accumulators of a warp at one row tile.
constexpr int kRowsPad = (kRows + 15) / 16 * 16;
constexpr int kGR = kRowsPad < 64 ? kRowsPad : 64;   // packed rows per pass
constexpr int kPasses = (kRowsPad + kGR - 1) / kGR;
constexpr int kMT = kGR / 16;                         // row tiles per pass (1..4)
// Warps: kWQ along rows (one row tile each), kWK along the keys of a tile (each takes
// kKW keys; their softmax states are merged at the end). Small N·G (the MHA draft-extend
// case, 4-16 rows) thus still keeps all four warps busy.
constexpr int kWQ = kMT;
constexpr int kWK = imin(kWarps / kWQ, kTile / 16);
constexpr int kKW = kTile / kWK;                      // keys per warp per tile (multiple of 16)
constexpr int kActive = kWQ * kWK;                    // warps doing MMA work (3 of 4 for kMT = 3)
static_assert(kKW % 16 == 0 && kWK >= 1, "keys per warp must be a multiple of 16");

constexpr int kStages = (int)STAGES;  // K/V pipeline depth (tiles in shared memory)
static_assert(kStages >= 2 && kStages <= 4, "STAGES must be 2, 3 or 4");
constexpr int kChunks = kD / 8;      // 16-byte chunks per K/V/q row
constexpr int kKS = kD / 16;         // MMA k-steps over the head dim
constexpr int kNTS = kKW / 8;        // score n-tiles (8 keys) per warp
constexpr int kNTO = kD / 8;         // output n-tiles (8 dims)
// q fragments stay in registers across the key loop when that fits comfortably
// (HEAD_DIM <= 128: 32 registers); wider heads reload them from shared memory.
constexpr bool kQRegs = kD <= 128;

// Shared memory layout (bytes), matching the formula in the header comment.
constexpr int kQBytes = kGR * kD * 2;
constexpr int kTileBytes = kTile * kD * 2;
constexpr int kStageBytes = kStages * 2 * kTileBytes;
constexpr int kMergeBytes = kWarps * 16 * kD * 4 + kWarps * 16 * 2 * 4;
// Offsets in 16-byte units as 32-bit words (every stride is a multiple of 8 elements and the
// registration bounds a layer's pool to 2^32 - 1 units): 8-byte offsets put llama's 64-row
// CTA (113.5 KiB) 512 bytes past two per SM.
constexpr int kSlotBytes = kStages * kTile * 4;  // one row per stage
constexpr unsigned kNoSlot = 0xffffffffu;
// A cluster's merge (below): this CTA's merged o and lse (log2 units) of each packed row of
// the pass, read by the other CTAs of the cluster. After the merge area, inside the stage
// area whenever it is large enough (3 x 64-key tiles: it is).
constexpr int kResBytes = kGR * kD * 4 + kGR * 4;
constexpr int kSmemBytes = kQBytes + imax(kStageBytes, kMergeBytes + kResBytes) + kSlotBytes;
static_assert(kSmemBytes <= 227 * 1024, "attn_partial shared memory exceeds 227 KiB");

// Rows of q, K and V tiles are kChunks 16-byte chunks; chunk c of row t is stored at chunk
// c ^ (t & kSwz). ldmatrix reads one logical chunk of 8 consecutive rows per 8x8 matrix;
// without the XOR those eight 16-byte reads would share banks (rows are 2*HEAD_DIM bytes,
// a multiple of 128 for HEAD_DIM 64/128/256); with it they cover all 32 banks.
constexpr int kSwz = (kChunks % 8 == 0) ? 7 : (kChunks % 4 == 0) ? 3 : (kChunks % 2 == 0) ? 1 : 0;
__device__ __forceinline__ int chunk_at(int row, int c) { return row * kD + ((c ^ (row & kSwz)) << 3); }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x in one MUFU.EX2 (exp2f adds a range test and two scalings a call for results below
// 2^-126, which flush to 0 here, probabilities and rescale factors alike: a term that small
// is below the last bit of a row's sum, about 1 or more). ex2(-inf) = 0, ex2(0) = 1 exactly.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The largest cluster the merge reads (MAX_ATTN_SPLITS; a plan validates its splits).
constexpr unsigned kMaxSplits = 16;

// The exact log-sum-exp merge of the splits' normalized o: sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse) (base 2 when kLog2, the cluster merge's units; else e, the
// partials' units); a split with lse = -inf weighs 0; 0 when every split is empty.
template <bool kLog2>
__device__ __forceinline__ float merge_splits(const float (&lse)[kMaxSplits], const float (&o)[kMaxSplits]) {
    float mx = neg_inf();
#pragma unroll
    for (unsigned s = 0; s < kMaxSplits; ++s) mx = fmaxf(mx, lse[s]);
    float num = 0.0f, den = 0.0f;
    if (mx != neg_inf()) {
#pragma unroll
        for (unsigned s = 0; s < kMaxSplits; ++s) {
            if (lse[s] != neg_inf()) {  // an empty split weighs 0 (and its o is 0 anyway)
                const float w = kLog2 ? exp2f(lse[s] - mx) : expf(lse[s] - mx);
                den += w;
                num = fmaf(w, o[s], num);
            }
        }
    }
    return den > 0.0f ? num / den : 0.0f;
}

// ---- Tensor-core fragments -------------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const act_t* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const act_t* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// d += a (16x16, row major) * b (16x8, column major), fp32 accumulators; the operand type
// follows act_t.
template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (IsHalf<act_t>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Loading one tile (keys [tile0, tile0 + kTile)) takes three steps:
//   tile_entries: thread k < kTile reads the table entry of key k (kv_entry) into a
//                 register; nothing uses it yet, so the read stays in flight;
//   tile_slots:   later (after a tile's compute) it turns the entry into the token slot
//                 (kv_resolve) and that into the key's offset in the pool in 16-byte
//                 units, this CTA's kv head included (kv_at: the registered geometry), and
//                 stores it in the tile's row of shared memory;
//   issue_tile:   after a barrier, every thread issues the cp.async copies of its chunks
//                 at that row's offsets.
// The table read, the guards and the geometry's arithmetic run once per key, not once per
// 16-byte chunk (a key of HEAD_DIM 128 is 16 chunks of K and 16 of V, and with page size 1
// every key is its own table read). The main loop reads tile t+kStages's entries right after issuing tile
// t+kStages-1's copies, stores their slots at the top of the next iteration and publishes
// them with that iteration's barrier. Each tile in flight has its own row (kStages rows).
constexpr int kLoadIters = (kTile * kChunks + kThreads - 1) / kThreads;
constexpr int kKeyIters = (kTile + kThreads - 1) / kThreads;  // keys per thread (1 when kTile <= threads)
constexpr int kQIters = (kGR * kChunks + kThreads - 1) / kThreads;  // q chunks per thread

struct TileEntries {
    int entry[kKeyIters];
    bool has[kKeyIters];
};

// The cache position of key index t of a request with prefix L (see kLanes).
__device__ __forceinline__ long long key_pos(int t, int L) {
    if (!kLanes || t < L) return t;
    const int u = t - L;
    return (long long)L + lane_offset(L, u / kLaneKeys, (int)LANE_STEPS, kN, kPage) + u % kLaneKeys;
}

__device__ __forceinline__ void tile_entries(TileEntries& e, int tile0, int hi, int L, const KvLayout& lay,
                                             const int* row) {
#pragma unroll
    for (int it = 0; it < kKeyIters; ++it) {
        const int k = (int)threadIdx.x + it * kThreads;
        const int p = tile0 + k;
        e.entry[it] = 0;  // defined even when kv_entry is not reached
        e.has[it] = k < kTile && p < hi && kv_entry(lay, row, key_pos(p, L), kPage, e.entry[it]);
    }
}

// The offset (head `head_off` included) of each key of the tile in the pool in 16-byte
// units, or kNoSlot when the key is outside the split (p >= hi) or has no slot (common.cuh
// kv_token): such keys are zero-filled.
__device__ __forceinline__ void tile_slots(unsigned* dst, const TileEntries& e, int tile0, int L, const KvLayout& lay,
                                           long long head_off) {
#pragma unroll
    for (int it = 0; it < kKeyIters; ++it) {
        const int k = (int)threadIdx.x + it * kThreads;
        if (k < kTile) {
            const long long t = kv_resolve(lay, e.has[it], e.entry[it], key_pos(tile0 + k, L), kPage);
            const long long units = t < 0 ? -1 : (kv_at(lay, t) + head_off) >> 3;
            dst[k] = units < 0 || units >= (long long)kNoSlot ? kNoSlot : (unsigned)units;
        }
    }
}

// base + 16 * u as one 64-bit multiply-add in PTX (ptxas expands it into a shift, a high
// multiply and an add with carry, shared by the K and V copies: 6 instructions a pair where
// the element arithmetic in C++ gave about 10).
__device__ __forceinline__ const char* at_unit(const char* base, unsigned u) {
    const char* r;
    asm("mad.wide.u32 %0, %1, 16, %2;" : "=l"(r) : "r"(u), "l"(base));
    return r;
}
constexpr bool kWholeKeys = kThreads % kChunks == 0 && (kTile * kChunks) % kThreads == 0;
constexpr int kKeyStep = kThreads / kChunks;  // keys a pass of the block covers (kWholeKeys)

// Issues the copies of one tile into dK and dV from its row of slots. Keys without a slot
// are zero-filled: a masked key has probability 0, and 0 * (stale NaN bits) would poison o.
//
// Copy q = tid + it * kThreads is chunk q % kChunks of key q / kChunks. When the block covers
// whole keys and the tile whole blocks (kThreads % kChunks == 0 and kTile * kChunks a multiple
// of kThreads: kWholeKeys), that is chunk c = tid % kChunks of key tid / kChunks + it *
// kKeyStep, c the thread's for every key, so each copy's source is `at_unit` of a per-thread
// base: about 16 instructions a K and V pair, with the slot's read and the destination, where
// the general loop takes 25 (the loader was a fifth of the key loop's instructions). Other
// shapes take the general loop.
__device__ __forceinline__ void issue_tile(act_t* dK, act_t* dV, const act_t* k_cache, const act_t* v_cache,
                                           const unsigned* off) {
    const int tid = (int)threadIdx.x;
    if constexpr (kWholeKeys) {
        const int c = tid % kChunks, t0 = tid / kChunks;
        const char* kc = reinterpret_cast<const char*>(k_cache) + c * 16;
        const char* vc = reinterpret_cast<const char*>(v_cache) + c * 16;
#pragma unroll
        for (int it = 0; it < kLoadIters; ++it) {
            const int t = t0 + it * kKeyStep;
            const unsigned o = off[t];
            const bool valid = o != kNoSlot;
            // An invalid key's copy has source size 0: nothing is read at its address.
            const unsigned u = valid ? o : 0u;
            const int d = chunk_at(t, c);
            cp_async16(dK + d, at_unit(kc, u), valid);
            cp_async16(dV + d, at_unit(vc, u), valid);
        }
    } else {
#pragma unroll
        for (int it = 0; it < kLoadIters; ++it) {
            const int q = tid + it * kThreads;
            if (q < kTile * kChunks) {
                const int t = q / kChunks, c = q % kChunks;
                const unsigned o = off[t];
                const bool valid = o != kNoSlot;
                const long long at = valid ? (long long)o * 8 + c * 8 : 0;
                cp_async16(dK + chunk_at(t, c), k_cache + at, valid);
                cp_async16(dV + chunk_at(t, c), v_cache + at, valid);
            }
        }
    }
}

// Stage st of the pipeline: its K tile, then its V tile.
__device__ __forceinline__ act_t* stage_k(unsigned char* base, int st) {
    return reinterpret_cast<act_t*>(base + st * 2 * kTileBytes);
}
__device__ __forceinline__ act_t* stage_v(unsigned char* base, int st) {
    return reinterpret_cast<act_t*>(base + st * 2 * kTileBytes + kTileBytes);
}

// The merge of a (request i, kv head g) group's splits in its last CTA (attn_fused): every
// packed row's output, exactly as attn_merge computes it, from the partials the group's CTAs
// wrote, read through L2 (__ldcg: other SMs wrote them, and a line in this SM's L1 or the
// read-only path could be stale). Each row's split lse are staged in `sLse` ([kRows][16]
// floats of dead shared memory) once; each thread then has kPer outputs' 16 partials in
// flight at a time (kRows <= ATTN_LAST_CTA_ROWS: 4 outputs a thread at G 4, D 128).
template <typename P>
__device__ __forceinline__ void merge_group(const P& p, int i, int g, long long rows, unsigned splits, float* sLse,
                                            int tid) {
    for (int e = tid; e < kRows * (int)kMaxSplits; e += kThreads) {
        const int rr = e / (int)kMaxSplits;
        const unsigned s = (unsigned)(e % (int)kMaxSplits);
        const long long r = (long long)i * kN + rr / kG;
        const int h = g * kG + rr % kG;
        sLse[e] = s < splits ? __ldcg(p.part_lse + ((long long)s * rows + r) * kHeads + h) : neg_inf();
    }
    __syncthreads();
    constexpr int kPer = 4;
    constexpr int kElems = kRows * kD;
    for (int base = tid; base < kElems; base += kThreads * kPer) {
        float o[kPer][kMaxSplits];
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
            const int e = base + u * kThreads;
            const int rr = e / kD, d = e % kD;
            const long long r = (long long)i * kN + rr / kG;
            const int h = g * kG + rr % kG;
#pragma unroll
            for (unsigned s = 0; s < kMaxSplits; ++s) {
                o[u][s] = e < kElems && s < splits
                              ? __ldcg(p.part_o + (((long long)s * rows + r) * kHeads + h) * kD + d)
                              : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
            const int e = base + u * kThreads;
            if (e >= kElems) continue;
            const int rr = e / kD, d = e % kD;
            const long long r = (long long)i * kN + rr / kG;
            const int h = g * kG + rr % kG;
            float lse[kMaxSplits];
#pragma unroll
            for (unsigned s = 0; s < kMaxSplits; ++s) lse[s] = sLse[rr * (int)kMaxSplits + (int)s];
            p.out[r * ((long long)kHeads * kD) + (long long)h * kD + d] = to_act(merge_splits<false>(lse, o[u]));
        }
    }
}

}  // namespace attn

// AttnPartialParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

namespace attn {

// One CTA of attn_partial (kFused false) or attn_fused (true: the partials' merge in the
// group's last CTA, below). Both entries run this body, so they compute the same partials.
template <bool kFused, typename P>
__device__ __forceinline__ void attn_cta(const P& p) {

    extern __shared__ __align__(128) unsigned char attn_smem[];
    act_t* sQ = reinterpret_cast<act_t*>(attn_smem);
    unsigned char* stage_base = attn_smem + kQBytes;
    // After the key loop the stage area holds each warp's unnormalized o, m and l.
    float* sO = reinterpret_cast<float*>(stage_base);                // [kWarps][16][kD]
    float* sM = sO + kWarps * 16 * kD;                               // [kWarps][16]
    float* sL = sM + kWarps * 16;                                    // [kWarps][16]
    // Offsets of the tiles' keys in flight, [kStages][kTile], outside the aliased area.
    unsigned* sSlot = reinterpret_cast<unsigned*>(stage_base + imax(kStageBytes, kMergeBytes + kResBytes));
    float* sRes = reinterpret_cast<float*>(stage_base + kMergeBytes);  // [kGR][kD]
    float* sLse = sRes + kGR * kD;                                     // [kGR]

    const int i = (int)blockIdx.x;  // request
    const int g = (int)blockIdx.y;  // kv head
    const int s = (int)blockIdx.z;  // KV split
    const unsigned splits = p.splits > 0u ? p.splits : 1u;
    // Uniform per CTA, before any barrier.
    if ((unsigned)i >= p.batch || g >= kKvHeads || (unsigned)s >= splits) return;

    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wq = warp % kWQ, wk = warp / kWQ;  // row tile, key slice (warp < kActive)
    const bool active = warp < kActive;
    // This request's page-table row (null: no row, every key then reads as zero).
    const KvLayout lay = kv_layout(p.kv_layout);
    const int* pt_row = kv_row(lay, p.page_table, p.req_slots[i]);
    // This CTA's kv head within every slot (the geometry's head stride).
    const long long head_off = (long long)g * lay.head_stride;

    // ---- This split's key range ----------------------------------------------------------
    // Over the selected queries (kSelectFrom = N): request i's one query row is its accepted
    // row sel = A_i - 1 of the N, at position L + sel. It sees every key up to and including
    // its own, so its range is that of a one-row request with prefix L + sel: the keys past
    // it are the unselected rows' K/V, which no output this instance keeps reads.
    int sel = 0;
    if constexpr (kSelectFrom > 0) {
        const int a = p.accept_lens[i];
        sel = (a < 1 ? 1 : (a > kSelectFrom ? kSelectFrom : a)) - 1;
    }
    // A prefix past kMaxPrefix (never admitted: the host refuses it) is read as kMaxPrefix, so
    // no int below (kv_len, the split bounds, the mask bound) can wrap.
    const long long l_sel = (long long)p.prefix_lens[i] + sel;
    const int L = l_sel > kMaxPrefix ? kMaxPrefix : (int)l_sel;
    // Draft decode: the prefix and every lane's STEP + 1 slots (kLanes); the window counts
    // from the rows' position L + STEP and never drops a lane key's index range.
    const long long kv_len = kLanes ? (long long)L + (long long)kN * kLaneKeys : (long long)L + kN;
    long long kv_start = 0;
    if (kWindow > 0) {
        kv_start = (long long)L - kWindow + 1 + (kLanes ? (long long)STEP : 0);
        if (kv_start < 0) kv_start = 0;
        if (kLanes && kv_start > L) kv_start = L;
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
    // Keys every row of this request sees without a mask test: [lo, L] minus the window.
    const int no_mask_end = kWindow > 0 ? lo : (kLanes ? L : L + 1);  // with a window every tile is tested

    const long long rows = (long long)p.batch * kN;
    const bool single = gridDim.z == 1u;
    // Launched as clusters of the splits (1, 1, splits): the CTAs merge their results
    // through distributed shared memory and write `out`; otherwise they write partials.
    const unsigned csize = cluster_size();
    // (splits == gridDim.z too: a CTA past the splits returns above, and its peers would
    // wait for it at the cluster barrier forever; validated plans always match.)
    bool clustered = false;
    if constexpr (!kFused) clustered = !single && p.cluster == gridDim.z && csize == gridDim.z && splits == gridDim.z;
    bool can_write = single || clustered ? p.out != nullptr : (p.part_o != nullptr && p.part_lse != nullptr);
    // attn_fused's group merge writes out and counts in the counters: both or nothing.
    if constexpr (kFused) can_write = can_write && p.out != nullptr && p.counters != nullptr;
    const float scale2 = kScale * kLog2e;  // scores in log2 units: exp2 instead of exp

    for (int pass = 0; pass < kPasses; ++pass) {
        const int prow0 = pass * kGR;  // first packed row of this pass

        // ---- q rows of the pass -> sQ (act_t, swizzled), zero for padding rows ---------------
        // As cp.async copies in a commit group of their own, issued first: every chunk is in
        // flight at once and under the table reads below (a load-then-store loop waits one
        // memory latency per iteration: 8 of them for 64 packed rows). Unaligned q (a
        // caller's view) takes the plain loads after the prologue; its group is then empty.
        const act_t* qbase = p.q + ((long long)i * kQRowsPerRequest + sel) * p.q_stride + (long long)g * kG * kD;
        const bool qvec = aligned16(p.q) && p.q_stride % 8u == 0u;
        if (qvec) {
#pragma unroll
            for (int it = 0; it < kQIters; ++it) {
                const int v = tid + it * kThreads;
                if (v < kGR * kChunks) {
                    const int rl = v / kChunks, c = v % kChunks;
                    const int rr = prow0 + rl;
                    const bool real = rr < kRows;
                    // A padding row copies 0 bytes (zero fill) from a valid address.
                    const act_t* src =
                        real ? qbase + (long long)(rr / kG) * p.q_stride + (long long)(rr % kG) * kD + c * 8 : qbase;
                    cp_async16(sQ + chunk_at(rl, c), src, real);
                }
            }
        }
        cp_async_commit();

        // ---- Pipeline prologue: the entries of tiles 0 .. kStages-2 read together (one
        // table latency, not one a tile), their slots, their copies, and the entries of tile
        // kStages-1 in flight
        TileEntries ent;
        {
            TileEntries first[kStages - 1];
#pragma unroll
            for (int st = 0; st < kStages - 1; ++st) {
                if (st < num_tiles) tile_entries(first[st], lo + st * kTile, hi, L, lay, pt_row);
            }
#pragma unroll
            for (int st = 0; st < kStages - 1; ++st) {
                if (st < num_tiles) tile_slots(sSlot + st * kTile, first[st], lo + st * kTile, L, lay, head_off);
            }
        }
        __syncthreads();  // the slot rows are written
#pragma unroll
        for (int st = 0; st < kStages - 1; ++st) {
            if (st < num_tiles) {
                issue_tile(stage_k(stage_base, st), stage_v(stage_base, st), p.k_cache, p.v_cache,
                           sSlot + st * kTile);
            }
            cp_async_commit();  // (possibly empty: keeps the group count uniform)
        }
        if (kStages - 1 < num_tiles) tile_entries(ent, lo + (kStages - 1) * kTile, hi, L, lay, pt_row);

        if (!qvec) {
            for (int v = tid; v < kGR * kChunks; v += kThreads) {
                const int rl = v / kChunks, c = v % kChunks;
                const int rr = prow0 + rl;
                act_t* dst = sQ + chunk_at(rl, c);
                if (rr < kRows) {
                    const act_t* src = qbase + (long long)(rr / kG) * p.q_stride + (long long)(rr % kG) * kD + c * 8;
#pragma unroll
                    for (int e = 0; e < 8; ++e) dst[e] = src[e];
                } else {
                    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        // q's group is the oldest: at most the kStages - 1 tile groups may still be pending.
        cp_async_wait<kStages - 1>();
        __syncthreads();  // sQ is written

        // Packed rows of this thread's accumulator halves: rows rA (c0, c1) and rA + 8 (c2, c3).
        const int rA = prow0 + wq * 16 + (lane >> 2);
        // Causal limits (draft-extend), or the lanes of the rows and their position (decode).
        const int qposA = kLanes ? L + (int)STEP : L + rA / kG, qposB = kLanes ? L + (int)STEP : L + (rA + 8) / kG;
        const int laneA = rA / kG, laneB = (rA + 8) / kG;
        const bool realA = rA < kRows, realB = rA + 8 < kRows;

        unsigned qf[kQRegs ? kKS : 1][4];
        if constexpr (kQRegs) {
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) {
                const int mi = lane >> 3;
                ldsm_x4(qf[ks], sQ + chunk_at(wq * 16 + (lane & 7) + (mi & 1) * 8, ks * 2 + (mi >> 1)));
            }
        }

        float o[kNTO][4];
#pragma unroll
        for (int nt = 0; nt < kNTO; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
        float mA = neg_inf(), mB = neg_inf(), lA = 0.0f, lB = 0.0f;  // l: this lane's columns only

        // ---- Key loop ---------------------------------------------------------------------
        for (int tile = 0; tile < num_tiles; ++tile) {
            const int nxt = tile + kStages - 1;
            // Tile nxt's entries were read during the last tile's compute: its slots go to
            // row nxt % kStages, last read when tile nxt - kStages was issued (before an
            // earlier barrier), and the barrier below publishes them.
            if (nxt < num_tiles) tile_slots(sSlot + (nxt % kStages) * kTile, ent, lo + nxt * kTile, L, lay, head_off);
            cp_async_wait<kStages - 2>();  // this thread's copies of tile `tile` have landed ...
            __syncthreads();               // ... and everyone's; stage (tile-1) is free again
            if (nxt < num_tiles) {
                issue_tile(stage_k(stage_base, nxt % kStages), stage_v(stage_base, nxt % kStages), p.k_cache,
                           p.v_cache, sSlot + (nxt % kStages) * kTile);
            }
            cp_async_commit();
            if (nxt + 1 < num_tiles) tile_entries(ent, lo + (nxt + 1) * kTile, hi, L, lay, pt_row);
            if (!active) continue;  // warp uniform; such warps only help with the copies

            const act_t* K = stage_k(stage_base, tile % kStages);
            const act_t* V = stage_v(stage_base, tile % kStages);
            const int kb = wk * kKW;                      // this warp's keys within the tile
            const int key0 = lo + tile * kTile + kb;      // position of its first key

            // -- S = q Kᵀ for 16 rows x kKW keys ---------------------------------------------
            float sc[kNTS][4];
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) {
                unsigned a[4];
                if constexpr (kQRegs) {
                    a[0] = qf[ks][0], a[1] = qf[ks][1], a[2] = qf[ks][2], a[3] = qf[ks][3];
                } else {
                    const int mi = lane >> 3;
                    ldsm_x4(a, sQ + chunk_at(wq * 16 + (lane & 7) + (mi & 1) * 8, ks * 2 + (mi >> 1)));
                }
#pragma unroll
                for (int np = 0; np < kKW / 16; ++np) {
                    // Matrices: keys +0..7 / dims lo, keys +0..7 / dims hi, keys +8..15 / lo, +8..15 / hi.
                    const int mi = lane >> 3;
                    unsigned b[4];
                    ldsm_x4(b, K + chunk_at(kb + np * 16 + (lane & 7) + (mi >> 1) * 8, ks * 2 + (mi & 1)));
                    mma16816(sc[2 * np], a, b[0], b[1]);
                    mma16816(sc[2 * np + 1], a, b[2], b[3]);
                }
            }

            // -- Mask and online softmax (rows rA, rA + 8; 4 lanes share a row) -------------
            // Scores stay unscaled here: SCALE * log2 e > 0, so the row max of the raw scores
            // scaled is the max of the scaled scores (bit for bit), and each probability is
            // one FFMA and one ex2 (one rounding of s * scale - m where a product and a
            // difference had two: the probabilities move by rounding only). The mask is a
            // branch of its own around the whole tile (a full tile skips it: predicated per
            // score it cost ~6 issue slots a score).
            const bool full = key0 + kKW <= no_mask_end && key0 + kKW <= hi;
            if (!full) {
#pragma unroll
                for (int nt = 0; nt < kNTS; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kp = key0 + nt * 8 + (lane & 3) * 2 + e;
                        const bool in = kp < hi;
                        bool visA, visB;
                        if constexpr (kLanes) {
                            // The prefix, and the row's own lane; the window by sequence
                            // position (a lane's j-th slot sits at L + j).
                            const bool pre = kp < L;
                            const int u = kp - L;
                            const int seq = pre ? kp : L + u % kLaneKeys;
                            const bool win = kWindow == 0 || seq + kWindow > qposA;
                            visA = realA && in && (pre || u / kLaneKeys == laneA) && win;
                            visB = realB && in && (pre || u / kLaneKeys == laneB) && win;
                        } else {
                            visA = realA && in && kp <= qposA && (kWindow == 0 || kp + kWindow > qposA);
                            visB = realB && in && kp <= qposB && (kWindow == 0 || kp + kWindow > qposB);
                        }
                        if (!visA) sc[nt][e] = neg_inf();
                        if (!visB) sc[nt][2 + e] = neg_inf();
                    }
                }
            }
            float tmaxA = neg_inf(), tmaxB = neg_inf();
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt) {
                tmaxA = fmaxf(tmaxA, fmaxf(sc[nt][0], sc[nt][1]));
                tmaxB = fmaxf(tmaxB, fmaxf(sc[nt][2], sc[nt][3]));
            }
            tmaxA = fmaxf(tmaxA, __shfl_xor_sync(0xffffffffu, tmaxA, 1));
            tmaxA = fmaxf(tmaxA, __shfl_xor_sync(0xffffffffu, tmaxA, 2));
            tmaxB = fmaxf(tmaxB, __shfl_xor_sync(0xffffffffu, tmaxB, 1));
            tmaxB = fmaxf(tmaxB, __shfl_xor_sync(0xffffffffu, tmaxB, 2));
            const float mA_new = fmaxf(mA, tmaxA * scale2), mB_new = fmaxf(mB, tmaxB * scale2);
            // While a row has seen no visible key m is -inf and l, o are 0; exp2(-inf - -inf)
            // would be NaN, so such factors are forced to 0.
            const float alphaA = mA == neg_inf() ? 0.0f : ex2_ftz(mA - mA_new);
            const float alphaB = mB == neg_inf() ? 0.0f : ex2_ftz(mB - mB_new);
            mA = mA_new;
            mB = mB_new;
            const float subA = mA == neg_inf() ? 0.0f : mA, subB = mB == neg_inf() ? 0.0f : mB;
            float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    sc[nt][e] = ex2_ftz(fmaf(sc[nt][e], scale2, -subA));  // masked: ex2(-inf) = 0
                    sc[nt][2 + e] = ex2_ftz(fmaf(sc[nt][2 + e], scale2, -subB));
                    sumA += sc[nt][e];
                    sumB += sc[nt][2 + e];
                }
            }
            lA = lA * alphaA + sumA;
            lB = lB * alphaB + sumB;
            // Once a row's max settles its factor is exactly 1 (ex2(0)): the accumulators are
            // rescaled only when some row of the warp moved (the same values: x * 1 = x).
            if (__any_sync(0xffffffffu, alphaA != 1.0f || alphaB != 1.0f)) {
#pragma unroll
                for (int nt = 0; nt < kNTO; ++nt) {
                    o[nt][0] *= alphaA;
                    o[nt][1] *= alphaA;
                    o[nt][2] *= alphaB;
                    o[nt][3] *= alphaB;
                }
            }

            // -- o += P V: P (16 x kKW) from the score registers, V via transposed ldmatrix --
#pragma unroll
            for (int kk = 0; kk < kKW / 16; ++kk) {
                unsigned a[4];
                a[0] = pack2(sc[2 * kk][0], sc[2 * kk][1]);
                a[1] = pack2(sc[2 * kk][2], sc[2 * kk][3]);
                a[2] = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                a[3] = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < kD / 16; ++dp) {
                    // Matrices: keys +0..7 / dims lo, keys +8..15 / lo, keys +0..7 / hi, +8..15 / hi.
                    const int mi = lane >> 3;
                    unsigned b[4];
                    ldsm_x4_trans(b, V + chunk_at(kb + kk * 16 + (lane & 7) + (mi & 1) * 8, dp * 2 + (mi >> 1)));
                    mma16816(o[2 * dp], a, b[0], b[1]);
                    mma16816(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }
        cp_async_wait<0>();  // no copy may land in the stage area once it holds the merge
        __syncthreads();     // every warp is done reading the stages

        // ---- Each warp's state -> shared memory -------------------------------------------
        if (active) {
            lA += __shfl_xor_sync(0xffffffffu, lA, 1);
            lA += __shfl_xor_sync(0xffffffffu, lA, 2);
            lB += __shfl_xor_sync(0xffffffffu, lB, 1);
            lB += __shfl_xor_sync(0xffffffffu, lB, 2);
        }
        if (kWK == 1 && !single) {
            // One warp saw all of a row's keys (three or four row tiles, or 16-key tiles): nothing
            // to merge across warps, so each lane writes its own accumulators, no shared memory
            // round trip. The values are those of the merge below with one slice (exp2(0) = 1,
            // fmaf(1, x, 0) = x), except that a -0 accumulator stays -0 here (the merge's
            // fmaf(1, -0, +0) gave +0); the merged output is the same. Only fp32 partials and
            // the cluster's rows: a lane's float2 covers a whole 32-byte sector with its row's
            // three neighbours, while act_t output from the fragments would be half sectors,
            // eight rows a store (measured 6-11% slower attention at llama3 N 16, B 32-64,
            // where splits = 1).
            if (active && can_write) {
                const bool part_vec = aligned16(p.part_o);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int rr = rA + half * 8;
                    if (rr >= kRows) continue;
                    const float m = half ? mB : mA, l = half ? lB : lA;
                    const bool any = m != neg_inf() && l > 0.0f;
                    const int rl = rr - prow0;
                    const int j = rr / kG, hh = rr % kG;
                    const long long r = (long long)i * kN + j;
                    const int h = g * kG + hh;
                    const long long sr = ((long long)s * rows + r) * kHeads + h;
                    // One division a row, not one an element (each an IEEE division with
                    // its slow-path test): o * (1 / l) is within an ulp of o / l.
                    const float inv = any ? 1.0f / l : 0.0f;
                    float v[kNTO][2];
#pragma unroll
                    for (int nt = 0; nt < kNTO; ++nt) {
                        v[nt][0] = any ? o[nt][2 * half] * inv : 0.0f;
                        v[nt][1] = any ? o[nt][2 * half + 1] * inv : 0.0f;
                    }
                    const int d0 = (lane & 3) * 2;  // + nt * 8
                    // The cluster's rows in shared memory, else this split's partials.
                    float* dst = clustered ? sRes + rl * kD + d0 : p.part_o + sr * kD + d0;
                    if (clustered || part_vec) {
#pragma unroll
                        for (int nt = 0; nt < kNTO; ++nt)
                            *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(v[nt][0], v[nt][1]);
                    } else {
#pragma unroll
                        for (int nt = 0; nt < kNTO; ++nt) dst[nt * 8] = v[nt][0], dst[nt * 8 + 1] = v[nt][1];
                    }
                    if ((lane & 3) == 0) {
                        if (clustered) {
                            sLse[rl] = any ? m + log2f(l) : neg_inf();
                        } else {
                            p.part_lse[sr] = any ? (m + log2f(l)) * kLn2 : neg_inf();
                        }
                    }
                }
            }
        } else {
            if (active) {
                const int ra = lane >> 2;
                float* so = sO + warp * 16 * kD;
#pragma unroll
                for (int nt = 0; nt < kNTO; ++nt) {
                    const int d = nt * 8 + (lane & 3) * 2;
                    *reinterpret_cast<float2*>(so + ra * kD + d) = make_float2(o[nt][0], o[nt][1]);
                    *reinterpret_cast<float2*>(so + (ra + 8) * kD + d) = make_float2(o[nt][2], o[nt][3]);
                }
                if ((lane & 3) == 0) {
                    sM[warp * 16 + ra] = mA;
                    sM[warp * 16 + ra + 8] = mB;
                    sL[warp * 16 + ra] = lA;
                    sL[warp * 16 + ra + 8] = lB;
                }
            }
            __syncthreads();

            // ---- Merge the kWK key slices of each row and write -------------------------------
            // Four dims of a row per iteration: the row's weights once, 16-byte shared memory
            // reads and partial writes (a dim per iteration was 64 dependent iterations a thread
            // for 64 packed rows). The same fp32 operations per element in the same order.
            constexpr int kDV = kD / 4;
            if (can_write) {
                const bool part_vec = aligned16(p.part_o);
                for (int e = tid; e < kGR * kDV; e += kThreads) {
                    const int rl = e / kDV, d0 = (e % kDV) * 4;
                    const int rr = prow0 + rl;
                    if (rr >= kRows) continue;
                    const int t = rl >> 4, x = rl & 15;
                    float mx = neg_inf();
#pragma unroll
                    for (int w = 0; w < kWK; ++w) mx = fmaxf(mx, sM[(t + w * kWQ) * 16 + x]);
                    float num[4] = {0.0f, 0.0f, 0.0f, 0.0f}, den = 0.0f;
                    if (mx != neg_inf()) {
#pragma unroll
                        for (int w = 0; w < kWK; ++w) {
                            const int ww = t + w * kWQ;
                            const float mw = sM[ww * 16 + x];
                            if (mw != neg_inf()) {
                                const float f = exp2f(mw - mx);
                                den = fmaf(f, sL[ww * 16 + x], den);
                                const float4 ov = *reinterpret_cast<const float4*>(sO + (ww * 16 + x) * kD + d0);
                                num[0] = fmaf(f, ov.x, num[0]);
                                num[1] = fmaf(f, ov.y, num[1]);
                                num[2] = fmaf(f, ov.z, num[2]);
                                num[3] = fmaf(f, ov.w, num[3]);
                            }
                        }
                    }
                    const bool any = den > 0.0f;
                    const float inv = any ? 1.0f / den : 0.0f;  // one division, as above
                    float res[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) res[k] = any ? num[k] * inv : 0.0f;
                    const int j = rr / kG, hh = rr % kG;
                    const long long r = (long long)i * kN + j;
                    const int h = g * kG + hh;
                    if (single) {
                        act_t* dst = p.out + r * ((long long)kHeads * kD) + (long long)h * kD + d0;
#pragma unroll
                        for (int k = 0; k < 4; ++k) dst[k] = to_act(res[k]);
                    } else if (clustered) {
                        *reinterpret_cast<float4*>(sRes + rl * kD + d0) = make_float4(res[0], res[1], res[2], res[3]);
                        if (d0 == 0) sLse[rl] = any ? mx + log2f(den) : neg_inf();
                    } else {
                        const long long sr = ((long long)s * rows + r) * kHeads + h;
                        float* dst = p.part_o + sr * kD + d0;
                        if (part_vec) {
                            *reinterpret_cast<float4*>(dst) = make_float4(res[0], res[1], res[2], res[3]);
                        } else {
#pragma unroll
                            for (int k = 0; k < 4; ++k) dst[k] = res[k];
                        }
                        if (d0 == 0) p.part_lse[sr] = any ? (mx + log2f(den)) * kLn2 : neg_inf();
                    }
                }
            }
        }  // kWK > 1, or a single split
        if (clustered) {
            // ---- The splits' merge inside the cluster ---------------------------------------
            // Every CTA's rows are in its shared memory; CTA c of the cluster merges packed
            // rows c, c + csize, ... of the pass over all csize CTAs (the exact log-sum-exp
            // merge of attn_merge, in log2 units) and writes them. The second barrier keeps
            // each CTA's shared memory alive (and unchanged) until every peer has read it.
            cluster_sync();
            const unsigned me = cluster_rank();
            const int mine = me < (unsigned)kGR ? (kGR - (int)me + (int)csize - 1) / (int)csize : 0;
            for (int e = tid; e < mine * kD && can_write; e += kThreads) {
                const int rl = (int)me + (e / kD) * (int)csize, d = e % kD;
                const int rr = prow0 + rl;
                if (rr >= kRows) continue;
                float lse[kMaxSplits], o[kMaxSplits];
#pragma unroll
                for (unsigned c = 0; c < kMaxSplits; ++c) {
                    lse[c] = c < csize ? ld_cluster(sLse + rl, c) : neg_inf();
                    o[c] = c < csize ? ld_cluster(sRes + rl * kD + d, c) : 0.0f;
                }
                const int j = rr / kG, hh = rr % kG;
                const long long r = (long long)i * kN + j;
                const int h = g * kG + hh;
                p.out[r * ((long long)kHeads * kD) + (long long)h * kD + d] = to_act(merge_splits<true>(lse, o));
            }
            cluster_sync();
        }
        if (pass + 1 < kPasses) __syncthreads();  // the merge area becomes stages (and sQ) again
    }
    // ---- attn_fused: the splits' merge in their last CTA --------------------------------
    // Every CTA of the group (request i, kv head g) has written its partials; thread 0 counts
    // the CTA into the group's counter with atomicInc(.., splits - 1), which wraps the word
    // back to 0 at the last arrival (as the next launch needs: kv.rs COUNTER_WORDS), and that
    // CTA merges. The fences are topk_fused's (sample.cu): after the barrier, thread 0's fence
    // orders the CTA's partial writes before its count (fences are cumulative over what the
    // barrier made visible); the last CTA's fence after its count orders its reads after every
    // other CTA's count. The conditions are uniform over the launch, so every CTA of a group
    // counts or none does.
    // (Only instances of at most 16 packed rows, ATTN_LAST_CTA_ROWS, compile it: validation
    // holds attn_fused to them, since the last CTA's merge grows with its rows:
    // docs/perf-notes.md items 39 and 52.)
    // (gridDim.z == splits too: a group with fewer CTAs than splits would leave its word
    // short of the wrap, for every later launch to read; validated plans always match.)
    if constexpr (kFused && kRows <= 16) {
    if (!single && can_write && gridDim.z == splits) {
        // The flag lives in the slot rows (dead after the key loop, outside the stage area
        // the merge stages its lse in): no static shared memory, so the footprint stays
        // attn_smem_bytes'.
        volatile unsigned* last_arrival = sSlot;
        __syncthreads();  // every warp is done with the stage area and its partial writes
        if (tid == 0) {
            __threadfence();
            const unsigned word = (unsigned)i * (unsigned)kKvHeads + (unsigned)g;
            const unsigned prev = atomicInc(reinterpret_cast<unsigned*>(p.counters) + word, splits - 1u);
            *last_arrival = prev == splits - 1u ? 1u : 0u;
            if (prev == splits - 1u) __threadfence();
        }
        __syncthreads();
        if (*last_arrival != 0u) merge_group(p, i, g, rows, splits, reinterpret_cast<float*>(stage_base), tid);
    }
    }
}

}  // namespace attn

extern "C" __global__ void __launch_bounds__(ATTN_PARTIAL_THREADS) attn_partial(AttnPartialParams p) {
    attn::attn_cta<false>(p);
}

// AttnFusedParams: declared by the prelude too. A wider instance compiles (one module per
// template) but does nothing: validation refuses its launch (ATTN_LAST_CTA_ROWS).
extern "C" __global__ void __launch_bounds__(ATTN_PARTIAL_THREADS) attn_fused(AttnFusedParams p) {
    if constexpr (attn::kRows <= 16) attn::attn_cta<true>(p);
}

// AttnMergeParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(ATTN_MERGE_THREADS) attn_merge(AttnMergeParams p) {
    constexpr long long kH = (long long)HEADS;
    constexpr long long kHD = (long long)HEAD_DIM;
    // Every split's lse and o are loaded before any is used (a loop over a runtime count
    // waits for each load in turn: 2 x splits memory latencies). The plan validates
    // splits <= 16 (MAX_ATTN_SPLITS); more read as the first 16.
    constexpr unsigned kMaxSplits = attn::kMaxSplits;
    const unsigned r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (r >= p.rows || h >= HEADS || d >= HEAD_DIM) return;

    const long long rows = p.rows;
    const unsigned splits = p.splits < kMaxSplits ? p.splits : kMaxSplits;
    float lse[kMaxSplits], o[kMaxSplits];
#pragma unroll
    for (unsigned s = 0; s < kMaxSplits; ++s) {
        const long long sr = ((long long)s * rows + r) * kH + h;
        lse[s] = s < splits ? p.part_lse[sr] : neg_inf();
        o[s] = s < splits ? p.part_o[sr * kHD + d] : 0.0f;
    }

    p.out[(long long)r * (kH * kHD) + (long long)h * kHD + d] = to_act(attn::merge_splits<false>(lse, o));
}
