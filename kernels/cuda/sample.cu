// sample.cu: softmax probabilities of the TOPK most likely columns of each logits row
// (the draft model's candidates; with FR-Spec the columns are a hot sub-vocabulary).
//
// For request i, x = logits[i*COLS .. (i+1)*COLS):
//   m = max_c x[c],  S = sum_c expf(x[c] - m)            (fp32; with REFINE, m and S after the
//                                                        refinement below)
//   the TOPK columns c_0..c_{TOPK-1} with the largest x, in descending order, ties
//   broken toward the LOWER column index;
//   probs[i*TOPK + k] = expf(x[c_k] - m) / S
//   ids[i*TOPK + k]   = HOT_MAP ? hot_ids[c_k] : (ID_OFFSET ? c_k + hot_ids[c_k] : c_k)
//                       (FR-Spec's hot list; EAGLE-3's d2t: draft id d -> target id d + d2t[d])
// NaN free for finite inputs. If COLS < TOPK, the missing entries get prob 0, id -1.
//
// Constants: COLS, TOPK (1..32), CANDS, HOT_MAP, ID_OFFSET, FULL_VOCAB, RANKS, COL_OFFSET,
// REFINE, HEAD_NORM, HIDDEN, EPS (act_t and stream_t: the refinement's rows).
// CANDS (KernelFacts::topk_cands): the candidates every list keeps, TOPK without REFINE,
// TOPK + 2 (at most 32) with it; the best TOPK of them are emitted.
//
// REFINE (KernelFacts::refines_topk: the fp32 stream of an unsharded draft-extend phase):
// after a row's best CANDS are found, their values are recomputed from the fp32 selected row
// — v_c = y . lm_w[c], y = x[i] or, with HEAD_NORM, rmsnorm(x[i], norm_w) — the reference max
// raised to the refined values, the sum rescaled and corrected to match, and the CANDS sorted
// again (refine_cands), the first TOPK emitted; the logits buffer itself keeps the GEMM's
// values. The two extra candidates are there because the lists are chosen on the GEMM's
// values: a near tie at the K-th place can swap there, and the refined values decide it.
// Both paths refine the row's final CANDS (softmax_topk its list, topk_merge the merged
// winners), so the result does not depend on the bucket's chunk count. Params x const stream_t* [batch, HIDDEN],
// norm_w const act_t* [HIDDEN] (HEAD_NORM, else null), lm_w const act_t* [COLS, HIDDEN]
// follow ids (softmax_topk, topk_merge); all three null without REFINE.
//
// A tensor-parallel rank (RANKS = T > 1) holds COLS columns of a T·COLS-column row,
// starting at column COL_OFFSET; its records carry full-row columns, every rank's records are
// gathered rank-major and topk_merge reads all of them (docs/tensor-parallel.md).
//
// Entry softmax_topk: the whole row in one CTA (used when the plan does not split rows).
//   Launch:  grid (batch, 1, 1), block (SOFTMAX_TOPK_THREADS = 512, 1, 1),
//            dynamic shared memory = 512 * CANDS * 8 bytes
//            (one sorted list of CANDS (value fp32, column int32) pairs per thread;
//            the Kernel declaration in specplan_kernels::entries::sample).
//   Params (by value, natural C alignment, fields in this order):
//     logits   const float*      [batch, COLS]
//     hot_ids  const long long*  [COLS] hot column -> full-vocabulary id (HOT_MAP), or the
//                                d2t offsets (ID_OFFSET); read only when either is set
//     probs    float*            [batch, TOPK]
//     ids      long long*        [batch, TOPK]
//     x, norm_w, lm_w            the refinement's (below; null without REFINE)
//     batch    unsigned          CTAs with blockIdx.x >= batch do nothing
//
// Entries topk_partial + topk_merge: the row split in `chunks` column ranges, one CTA each
// (one CTA streaming a 128k-column row is bound by one SM's instruction issue rate; measured
// in docs/perf-notes.md, "softmax_topk rows split across CTAs").
//   Chunk ch of a row covers columns [ch*W, min(COLS, (ch+1)*W)), W = ceil(COLS/chunks)
//   rounded up to a multiple of 4 (may be empty).
//   Record of (row i, chunk ch): part[(i*chunks + ch)*R ...], R = 2 + 2*CANDS floats:
//     [0] = the chunk's max m_ch (-inf if empty), [1] = sum over its columns of
//     expf(x - m_ch) (0 if empty), [2 .. 2+CANDS) = its CANDS largest values in the order
//     above, [2+CANDS .. 2+2*CANDS) = their columns as floats (exact: COLS < 2^24), -1 where
//     the chunk has fewer than CANDS columns (value -inf).
//   topk_partial: grid (batch, chunks, 1), block (TOPK_PARTIAL_THREADS = 512, 1, 1), shared memory as softmax_topk.
//     Params: logits const float* [batch, COLS], part float* [batch*chunks*R],
//             batch unsigned, chunks unsigned (1..32)
//     A record's columns are full-row columns: c + COL_OFFSET.
//   topk_merge: grid (batch, 1, 1), block (TOPK_MERGE_THREADS = 512, 1, 1), no dynamic shared
//     memory (the whole CTA stages the row's records in shared memory; then warp 0 merges,
//     and with REFINE every warp refines the winners).
//     Params: part const float*, hot_ids const long long*, probs float*, ids long long*,
//             x, norm_w, lm_w (the refinement's, above), batch unsigned,
//             chunks unsigned (RANKS * chunks <= 32)
//     The records of rank t (0..RANKS) follow each other: (t, row i, chunk ch) at
//     part[((t*batch + i)*chunks + ch)*R ...] (RANKS = 1: the layout above).
//     m = max m_ch, S = sum S_ch * expf(m_ch - m) over every rank's chunks, the CANDS best of
//     all records' candidates (same order), refined with REFINE, then the first TOPK's probs
//     and ids exactly
//     as softmax_topk's (over the RANKS*COLS columns of the full row).
//
// Entry topk_fused (RANKS = 1): topk_partial's launch, records and shared memory, and then
// topk_merge's merge of row i in the last of the row's CTAs to finish. Params: logits,
// part (written, then read back), hot_ids, probs, ids, x, norm_w, lm_w (as topk_merge's),
// counters unsigned* [batch] (the runtime's arrival counters: 0 before the launch, and 0
// again after it), batch unsigned, chunks unsigned (1..32).
//
// Entry logits_gather (a sharded plan's logits output): out[i, t*COLS + c] =
//   part[(t*batch + i)*COLS + c] for every rank t < RANKS — the all-gathered shares,
//   rank-major, as full rows.
//   Launch: grid (batch, RANKS, 1), block (LOGITS_GATHER_THREADS = 256, 1, 1), no shared memory.
//   Params: part const float* [RANKS*batch*COLS], out float* [batch, RANKS*COLS], batch unsigned
//
// Method (one CTA over a column range): each thread keeps a (max, sum of exp) pair, updated
// a batch of loads at a time, and a sorted top-CANDS list of its columns (in registers up to
// CANDS 8, else in shared memory).
// Then each warp takes its lanes' best CANDS in CANDS rounds (the best head wins and its lane
// advances), and warp 0 the same over the 16 warps' lists. The head of the final list is
// the range maximum m, and S = sum_t s_t * exp(m_t - m) (exp as exp2 of log2-e scaled
// differences: the fp32 result differs from expf's by rounding only).
#include "common.cuh"

// SoftmaxTopkParams, TopkPartialParams and TopkMergeParams are declared by the generated
// prelude, from specplan_kernels (#[derive(KernelParams)]): the Rust and C sides
// share one definition.

namespace topk {

constexpr int kThreads = (int)SOFTMAX_TOPK_THREADS;
// The per-row and per-chunk kernels share the list code below, sized by kThreads.
static_assert(SOFTMAX_TOPK_THREADS == TOPK_PARTIAL_THREADS, "softmax_topk and topk_partial share one block size");
static_assert(TOPK_MERGE_THREADS % 32u == 0u && TOPK_MERGE_THREADS >= 64u, "topk_merge: warp 0 merges (lane l owns record l), every warp stages and refines");
static_assert(kThreads % 32 == 0 && kThreads / 32 <= 32, "whole warps, at most 32: warp 0 merges a list per warp");
constexpr int kK = (int)TOPK;
// Every list's length: kK, plus the refinement's extra candidates (the header's CANDS).
constexpr int kL = (int)CANDS;
constexpr long long kCols = (long long)COLS;
constexpr int kRanks = (int)RANKS;
// Columns of the full row (every rank's share): the bound of a valid column in the records.
constexpr long long kAllCols = (long long)COLS * (long long)RANKS;
constexpr int kNoCol = 0x7fffffff;  // column of an empty list entry: loses every tie
constexpr float kLog2e = 1.4426950408889634f;
// Largest CANDS whose per-thread list `scan_range` keeps in registers (2 per entry; at 8,
// topk_partial's 64-register bound spills 8 bytes).
constexpr int kRegMax = 8;
static_assert(kK >= 1 && kK <= 32, "TOPK must be in [1, 32]");
static_assert(kL >= kK && kL <= 32 && (REFINE || kL == kK), "CANDS: TOPK, or more with REFINE, at most 32");
static_assert(RANKS >= 1u && RANKS <= 32u, "1..32 tensor-parallel ranks");
static_assert(COL_OFFSET % COLS == 0u && COL_OFFSET / COLS < RANKS, "a rank's share starts at rank * COLS");
static_assert((unsigned long long)COLS * RANKS <= FULL_VOCAB, "the logits cannot have more columns than the vocabulary");
static_assert(!(HOT_MAP && ID_OFFSET), "one id map at most");
// The refinement reads lm_head rows by the records' columns: only an unsharded row's
// (KernelFacts::refines_topk) are this instance's own rows.
static_assert(!REFINE || (RANKS == 1u && COL_OFFSET == 0u), "the refinement serves unsharded rows");
static_assert((unsigned long long)COLS * RANKS < (1ull << 24), "column indices travel as exact floats between the split kernels");

// Strict order "a ranks before b": larger value, then lower column.
__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

// Shared memory: entry k of thread t's list at [k*kThreads + t] (values, then columns).
// Interleaving by thread keeps every access pattern below free of bank conflicts: the
// 32 lanes of a warp always touch 32 consecutive thread slots, whatever k each one is at.
struct Lists {
    float* v;
    int* c;
    __device__ __forceinline__ float& val(int k, int slot) const { return v[k * kThreads + slot]; }
    __device__ __forceinline__ int& col(int k, int slot) const { return c[k * kThreads + slot]; }
};

// The best of the heads the lanes of a warp offer (larger value, then lower column), to
// every lane. An empty entry is (-inf, kNoCol): columns are otherwise unique within a range,
// so only empty entries can tie, and which of them wins does not matter.
__device__ __forceinline__ void warp_best(float& bv, int& bc) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oc = __shfl_xor_sync(0xffffffffu, bc, o);
        if (better(ov, oc, bv, bc)) {
            bv = ov;
            bc = oc;
        }
    }
}

// kL rounds over the sorted lists the 32 lanes of a warp own (list `slot`, or none when
// `slot` < 0): each round the best head wins and its lane advances. Lane k returns round
// k's winner (lanes >= kL: an empty entry). Reads shared memory only; no barrier.
__device__ __forceinline__ void warp_top(const Lists& L, int slot, float& out_v, int& out_c) {
    const int lane = (int)threadIdx.x & 31;
    int head = 0;
    float hv = slot >= 0 ? L.val(0, slot) : neg_inf();
    int hc = slot >= 0 ? L.col(0, slot) : kNoCol;
    out_v = neg_inf();
    out_c = kNoCol;
    for (int k = 0; k < kL; ++k) {
        float bv = hv;
        int bc = hc;
        warp_best(bv, bc);
        if (lane == k) {
            out_v = bv;
            out_c = bc;
        }
        if (hv == bv && hc == bc) {  // the winner's lane (or every lane, once all are empty)
            ++head;
            const bool more = slot >= 0 && head < kL;
            hv = more ? L.val(head, slot) : neg_inf();
            hc = more ? L.col(head, slot) : kNoCol;
        }
    }
}

// A lower bound of the kL-th largest value the warp's lanes have seen, from each lane's
// largest `v`: the kL-th largest of the 32 (kL lanes each hold a value at least that
// large), or lower where lanes tie (tied lanes drop out together), or -inf when fewer than
// kL lanes hold a finite value. Every lane calls it (full-warp shuffles) and gets the result.
__device__ __forceinline__ float warp_floor(float v) {
    float m = neg_inf();
#pragma unroll
    for (int k = 0; k < kL; ++k) {
        m = warp_max(v);
        if (v == m) v = neg_inf();
    }
    return m;
}

// Scans columns [c0, c1) of `row` with the whole CTA. On return (after a barrier) list 0
// holds the range's best kL (value, column) pairs in order and every thread has the range
// max `m` and sum `sum` of exp(x - m) (m = -inf, sum = 0 for an empty range).
//
// Why this shape (docs/perf-notes.md item 27): every load of a thread's columns is issued
// before any is used (a chunk of a few thousand columns is one or two float4 batches a
// thread: one memory latency, not one per float4); the sum of exp is kept per batch (its
// max first, then one exp2 per column, instead of a branch and an exp per column); a
// column enters the list on one comparison (a thread visits its columns in increasing
// order, so a value equal to its list's last only enters an empty slot), a list of up to
// kRegMax entries lives in registers (item 28: a shifted entry in shared memory cost a
// round trip each, and early in a scan nearly every column of some lane enters); the 512 lists
// meet in two levels of warp rounds (kL shuffle reductions each, three barriers) instead of a
// 9-level tree of shared-memory merges with a barrier per level.
__device__ __forceinline__ void scan_range(const float* row, long long c0, long long c1, const Lists& lists,
                                           float& m_out, float& sum_out) {
    const int t = (int)threadIdx.x;
    // The thread's list: in registers while kL <= kRegMax (the entry is a chain of kL
    // compare-and-swaps, no shared-memory round trip per shifted entry), else in shared
    // memory. Either way it is sorted best first.
    constexpr bool kRegs = kL <= kRegMax;
    float rv[kRegs ? kL : 1];
    int rc[kRegs ? kL : 1];
#pragma unroll
    for (int k = 0; k < kL; ++k) {
        if constexpr (kRegs) {
            rv[k] = neg_inf();
            rc[k] = kNoCol;
        } else {
            lists.val(k, t) = neg_inf();
            lists.col(k, t) = kNoCol;
        }
    }
    float worst_v = neg_inf();  // this thread's list entry kL-1 (the bar to enter the list)
    int worst_c = kNoCol;
    // A lower bound of the range's kL-th best (warp_floor of the lanes' maxima so far): a
    // column below it cannot be among the range's best kL, so it enters no list. Without it a
    // warp ran the insert path for nearly every column, for whichever lane entered it
    // (docs/perf-notes.md item 31).
    float floor_v = neg_inf();
    // Sum of exp2((x - tm) * log2 e) over this thread's columns, tm their max so far.
    float tm = neg_inf(), ts = 0.0f;

    // Column c (in the range) with value x: into the sorted list when it beats entry kL-1.
    auto insert = [&](float x, int c) {
        if (x < floor_v) return;  // below a value kL columns of the range reach (not NaN: -inf)
        if (!(x > worst_v || (x == worst_v && worst_c == kNoCol))) return;  // = !better(x, c, worst_v, worst_c)
        if constexpr (kRegs) {
            // Carried down the list: at each entry it beats, the two swap places.
            float v = x;
            int cc = c;
#pragma unroll
            for (int k = 0; k < kL; ++k) {
                if (better(v, cc, rv[k], rc[k])) {
                    const float tv = rv[k];
                    const int tc = rc[k];
                    rv[k] = v;
                    rc[k] = cc;
                    v = tv;
                    cc = tc;
                }
            }
            worst_v = rv[kL - 1];
            worst_c = rc[kL - 1];
        } else {
            int k = kL - 1;
            while (k > 0 && better(x, c, lists.val(k - 1, t), lists.col(k - 1, t))) {
                lists.val(k, t) = lists.val(k - 1, t);
                lists.col(k, t) = lists.col(k - 1, t);
                --k;
            }
            lists.val(k, t) = x;
            lists.col(k, t) = c;
            worst_v = lists.val(kL - 1, t);
            worst_c = lists.col(kL - 1, t);
        }
    };
    // A batch of values (-inf for a float4 past the range): its max, then its sum.
    auto add_sum = [&](const float* x, int n) {
        float bm = tm;
        for (int u = 0; u < n; ++u) bm = fmaxf(bm, x[u]);
        if (bm == neg_inf()) return;  // nothing finite yet: ts stays 0
        // (tm = -inf: ts is 0, and exp2(-inf) = 0 keeps it so.)
        ts *= exp2f((tm - bm) * kLog2e);
        tm = bm;
        // (x - bm) first: a scaled -bm could overflow for a finite bm past FLT_MAX / log2 e, and
        // the batch max's own term is exactly 1.
        for (int u = 0; u < n; ++u) ts += exp2f((x[u] - bm) * kLog2e);
    };

    // Each thread visits its columns in increasing order: float4 c0/4 + t, + kThreads, ...
    // when the range is 16-byte aligned, else single columns; kBatch float4 loads (predicated
    // past the range's end) are issued before any is used.
    constexpr int kBatch = 8;
    long long done = c0;
    if (aligned16(row + c0)) {
        const long long nv = (c1 - c0) / 4;
        const float4* row4 = reinterpret_cast<const float4*>(row + c0);
        // The loop's bound is the warp's (lane 0's v0), so every lane runs every iteration and
        // warp_floor's shuffles see all 32; a lane's float4s past the range read as -inf.
        const int lane = t & 31;
        for (long long w0 = t - lane; w0 < nv; w0 += (long long)kBatch * kThreads) {
            const long long v0 = w0 + lane;
            float x[kBatch * 4];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const long long v = v0 + (long long)u * kThreads;
                const float4 x4 = v < nv ? __ldg(row4 + v) : make_float4(neg_inf(), neg_inf(), neg_inf(), neg_inf());
                x[4 * u] = x4.x, x[4 * u + 1] = x4.y, x[4 * u + 2] = x4.z, x[4 * u + 3] = x4.w;
            }
            // A float4 past the range reads as -inf: no term of the sum, and kept out of
            // the list by the test below (a real -inf column would enter an empty slot).
            add_sum(x, kBatch * 4);
            floor_v = fmaxf(floor_v, warp_floor(tm));
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const long long v = v0 + (long long)u * kThreads;
                if (v < nv) {
                    const int c = (int)(c0 + v * 4);
                    insert(x[4 * u], c);
                    insert(x[4 * u + 1], c + 1);
                    insert(x[4 * u + 2], c + 2);
                    insert(x[4 * u + 3], c + 3);
                }
            }
        }
        done = c0 + nv * 4;
    }
    for (long long c = done + t; c < c1; c += kThreads) {
        const float x = row[c];
        add_sum(&x, 1);
        insert(x, (int)c);
    }

    if constexpr (kRegs) {
#pragma unroll
        for (int k = 0; k < kL; ++k) {
            lists.val(k, t) = rv[k];
            lists.col(k, t) = rc[k];
        }
    }

    // Every warp's best kL (lane k holds the k-th), stored as list w for warp w (the lists of
    // threads 0..kWarps-1 are all read by then), then warp 0's rounds over those lists.
    constexpr int kWarps = kThreads / 32;  // at most 32 (asserted above): a lane of warp 0 each
    const int lane = t & 31, warp = t >> 5;
    __syncthreads();  // every list is written
    float wv;
    int wc;
    warp_top(lists, t, wv, wc);
    __syncthreads();  // every list is read
    if (lane < kL) {
        lists.val(lane, warp) = wv;
        lists.col(lane, warp) = wc;
    }
    __syncthreads();
    if (warp == 0) {
        warp_top(lists, lane < kWarps ? lane : -1, wv, wc);
        __syncwarp();  // warp 0's reads of list 0 are done
        if (lane < kL) {
            lists.val(lane, 0) = wv;
            lists.col(lane, 0) = wc;
        }
    }
    __syncthreads();

    const float m = lists.val(0, 0);  // range maximum (head of the merged list)
    const float part = (tm == neg_inf() || m == neg_inf()) ? 0.0f : ts * exp2f((tm - m) * kLog2e);
    // Lists 1..511 are dead now: their first entries serve as the reduction scratch.
    m_out = m;
    sum_out = block_sum(part, &lists.val(0, 1));
}

// REFINE (the fp32 stream: an unsharded draft-extend phase): the logits came from lm_head's
// bf16 input, a rounding of the fp32 row y = x (EAGLE-1) or y = rmsnorm(x, norm_w) (HEAD_NORM,
// EAGLE-3's final norm, fp32 as norm.cu's without the rounding). The row's final kL candidates
// (values cv[k*stride], columns cc[k*stride], best first; a column outside [0, COLS) is an
// empty entry) are recomputed as v_c = y . lm_w[c] in fp32, the reference max becomes
// m' = max(m, v_c'), `sum` is rescaled to it and corrected by expf(v_c' - m') - expf(v_c - m')
// for each (no term exceeds 1, so a large correction cannot overflow; the other columns'
// share is clamped at 0), and the candidates are sorted again (larger value, lower column).
//
// Work: thread t owns elements t*8, t*8 + kT*8, ... of the row (single elements when the
// row or a weight is not 16-byte aligned) and keeps kL dot products, so every candidate's
// weight loads are in flight together (one CTA reads kL*H weights; measured in
// docs/perf-notes.md, "Top-K refinement in the merge"). With HEAD_NORM the row's sum of
// squares accumulates beside them and its rsqrt scales the sums: y . w = inv * (x*n) . w.
// Every thread of the CTA (kT of them) calls it with m != -inf; it ends with a barrier and
// returns m' and `sum` to all.
template <int kT>
__device__ __forceinline__ void refine_cands(float* cv, int* cc, int stride, float& m, float& sum,
                                             const stream_t* x, const act_t* norm_w, const act_t* lm_w) {
    constexpr long long H = (long long)HIDDEN;
    constexpr int kWarps = kT / 32;
    static_assert(kT % 32 == 0 && kL + 2 <= kT, "whole warps; one thread per candidate");
    __shared__ float part[kWarps][kL + 1];  // per-warp dot products, then the sum of squares
    __shared__ float fin[kL + 2];           // refined values, then the corrected sum and max
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    int col[kL];  // lm_head row of each candidate (row 0 for an empty entry: read, ignored)
    float acc[kL];
#pragma unroll
    for (int j = 0; j < kL; ++j) {
        const int c = cc[j * stride];
        col[j] = c >= 0 && (long long)c < kCols ? c : 0;
        acc[j] = 0.0f;
    }
    float ss = 0.0f;
    const bool vec = H % 8 == 0 && aligned16(x) && aligned16(lm_w) && (!HEAD_NORM || aligned16(norm_w));
    if (vec) {
        for (long long e = (long long)t * 8; e < H; e += (long long)kT * 8) {
            float xv[8];
            load_vec<8>(x + e, xv);
            if constexpr (HEAD_NORM) {
                float nv[8];
                load_vec<8>(norm_w + e, nv);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    ss += xv[k] * xv[k];
                    xv[k] *= nv[k];
                }
            }
#pragma unroll
            for (int j = 0; j < kL; ++j) {
                float wv[8];
                load_vec<8>(lm_w + (long long)col[j] * H + e, wv);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[j] += xv[k] * wv[k];
            }
        }
    } else {
        for (long long e = t; e < H; e += kT) {
            float y = to_f(x[e]);
            if constexpr (HEAD_NORM) {
                ss += y * y;
                y *= to_f(norm_w[e]);
            }
#pragma unroll
            for (int j = 0; j < kL; ++j) acc[j] += y * to_f(lm_w[(long long)col[j] * H + e]);
        }
    }
#pragma unroll
    for (int j = 0; j < kL; ++j) {
        const float s = warp_sum(acc[j]);
        if (lane == 0) part[warp][j] = s;
    }
    if constexpr (HEAD_NORM) {
        const float s = warp_sum(ss);
        if (lane == 0) part[warp][kL] = s;
    }
    __syncthreads();
    if (t < kL) {  // candidate t's dot product over the warps, scaled by the norm's rsqrt
        float inv = 1.0f;
        if constexpr (HEAD_NORM) {
            float tot = 0.0f;
            for (int w = 0; w < kWarps; ++w) tot += part[w][kL];
            inv = rsqrtf(tot / (float)H + EPS);
        }
        float dot = 0.0f;
        for (int w = 0; w < kWarps; ++w) dot += part[w][t];
        fin[t] = inv * dot;
    }
    __syncthreads();
    if (t == 0) {
        float m2 = m;
        for (int j = 0; j < kL; ++j) {
            const int c = cc[j * stride];
            if (c >= 0 && (long long)c < kCols) m2 = fmaxf(m2, fin[j]);
        }
        // The other columns' share (never negative; rounding could make the difference so),
        // then the refined candidates'.
        float s = sum * expf(m - m2);
        for (int j = 0; j < kL; ++j) {
            const int c = cc[j * stride];
            if (c >= 0 && (long long)c < kCols) s -= expf(cv[j * stride] - m2);
        }
        s = fmaxf(s, 0.0f);
        for (int j = 0; j < kL; ++j) {
            const int c = cc[j * stride];
            if (c < 0 || (long long)c >= kCols) continue;
            s += expf(fin[j] - m2);
            cv[j * stride] = fin[j];
        }
        // Insertion sort of the candidates (kL <= 32 entries, nearly in order) in their order.
        for (int j = 1; j < kL; ++j) {
            const float v = cv[j * stride];
            const int c = cc[j * stride];
            int k = j;
            while (k > 0 && better(v, c, cv[(k - 1) * stride], cc[(k - 1) * stride])) {
                cv[k * stride] = cv[(k - 1) * stride];
                cc[k * stride] = cc[(k - 1) * stride];
                --k;
            }
            cv[k * stride] = v;
            cc[k * stride] = c;
        }
        fin[kL] = s;
        fin[kL + 1] = m2;
    }
    __syncthreads();
    sum = fin[kL];
    m = fin[kL + 1];
}

// With an id map, column c's entry fetched into L2 while the refinement runs (`emit` reads
// it after; a load from DRAM there would be the kernel's last latency). No-op otherwise.
__device__ __forceinline__ void prefetch_id(const long long* hot_ids, int c) {
    if constexpr (HOT_MAP || ID_OFFSET) {
        if (c >= 0 && (long long)c < kAllCols) asm volatile("prefetch.L2 [%0];\n" ::"l"(hot_ids + c));  // generic address
    }
}

// Writes probs/ids of row i from its best kK (value, column) pairs, the row max m and sum.
__device__ __forceinline__ void emit(float v, int c, float m, float sum, const long long* hot_ids, float* probs,
                                     long long* ids, long long at) {
    const bool valid = c >= 0 && (long long)c < kAllCols;
    float prob = 0.0f;
    if (valid && m != neg_inf() && sum > 0.0f) prob = expf(v - m) / sum;
    long long id = -1;
    if (valid) {
        if constexpr (HOT_MAP) id = hot_ids[c];
        else if constexpr (ID_OFFSET) id = (long long)c + hot_ids[c];
        else id = c;
    }
    probs[at] = prob;
    ids[at] = id;
}

}  // namespace topk

extern "C" __global__ void __launch_bounds__(SOFTMAX_TOPK_THREADS) softmax_topk(SoftmaxTopkParams p) {
    using namespace topk;
    extern __shared__ __align__(16) unsigned char topk_smem[];
    const Lists lists{reinterpret_cast<float*>(topk_smem),
                      reinterpret_cast<int*>(topk_smem + (long long)kL * kThreads * 4)};
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;  // uniform per CTA
    const int t = (int)threadIdx.x;
    float m, sum;
    scan_range(p.logits + (long long)i * kCols, 0, kCols, lists, m, sum);
    if constexpr (REFINE) {
        if (t < kL) prefetch_id(p.hot_ids, lists.col(t, 0));
        if (m != neg_inf())  // uniform: every thread holds the range max
            refine_cands<kThreads>(&lists.val(0, 0), &lists.col(0, 0), kThreads, m, sum,
                                   p.x + (long long)i * HIDDEN, p.norm_w, p.lm_w);
    }
    if (t < kK) emit(lists.val(t, 0), lists.col(t, 0), m, sum, p.hot_ids, p.probs, p.ids, (long long)i * kK + t);
}

namespace topk {

// The merge of row i's records (`nrec` = RANKS * chunks of them, at most 32) by a CTA of kT
// threads: the records are staged in `recs` (shared memory, 32 * (kR + 1) floats) by the
// whole CTA, warp 0 merges them, and with REFINE every warp refines the winners; the row's
// TOPK probs and ids are written. `load(l, f)` reads field f of record l, where l = rank *
// chunks + chunk. Every thread of the CTA calls it (it has barriers); it returns after the
// row is emitted.
template <int kT, typename Load>
__device__ __forceinline__ void merge_row(unsigned i, int nrec, float* recs, Load load, const long long* hot_ids,
                                          float* probs, long long* ids, const stream_t* x, const act_t* norm_w,
                                          const act_t* lm_w) {
    // With REFINE: the winners and the row's (m, sum), for the whole CTA's refinement.
    __shared__ float win_v[kL];
    __shared__ int win_c[kL];
    __shared__ float row_ms[2];
    // The row's records, staged by the whole CTA before warp 0's rounds read them: every load
    // in flight together (a round's next head is known only after the round, so reading the
    // records in global memory cost two dependent loads a round). Record l at recs[l * kRS]:
    // an odd stride, so the 32 lanes' reads of one field hit 32 banks.
    constexpr int kR = 2 + 2 * kL;
    constexpr int kRS = kR + 1;
    const int t = (int)threadIdx.x;
    for (int e = t; e < nrec * kR; e += kT) {
        const int l = e / kR, f = e - l * kR;
        recs[l * kRS + f] = load(l, f);
    }
    __syncthreads();
    if (!REFINE && t >= 32) return;  // the records are staged: warp 0 merges, the rest only refine
    if (t < 32) {
        const int lane = t;
        // Lane l owns record l of row i.
        const bool mine = lane < nrec;
        const float* rec = recs + (mine ? lane : 0) * kRS;
        const float ml = mine ? rec[0] : neg_inf();
        const float sl = mine ? rec[1] : 0.0f;
        const float m = warp_max(ml);
        const float sum = warp_sum((ml == neg_inf() || m == neg_inf()) ? 0.0f : sl * expf(ml - m));
        // kL rounds: every lane offers the head of its (sorted) candidate list; the best head
        // wins (larger value, then lower column) and its lane advances.
        int head = 0;
        for (int k = 0; k < kL; ++k) {
            float v = neg_inf();
            int c = kNoCol;
            if (mine && head < kL) {
                const float cf = rec[2 + kL + head];
                if (cf >= 0.0f) {
                    v = rec[2 + head];
                    c = (int)cf;
                }
            }
            float bv = v;
            int bc = c, bl = lane;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oc = __shfl_xor_sync(0xffffffffu, bc, o);
                const int ol = __shfl_xor_sync(0xffffffffu, bl, o);
                if (better(ov, oc, bv, bc) || (ov == bv && oc == bc && ol < bl)) {
                    bv = ov;
                    bc = oc;
                    bl = ol;
                }
            }
            if (lane == bl) ++head;
            if (lane == 0) {
                const int col = bc == kNoCol ? -1 : bc;
                if constexpr (REFINE) {
                    // A column outside the row (only a corrupt record holds one) becomes an
                    // empty entry: it sorts last after the refinement and emits (0, -1).
                    const bool ok = col >= 0 && (long long)col < kAllCols;
                    win_v[k] = ok ? bv : neg_inf();
                    win_c[k] = ok ? col : -1;
                    prefetch_id(hot_ids, ok ? col : -1);
                } else {
                    emit(bv, col, m, sum, hot_ids, probs, ids, (long long)i * kK + k);
                }
            }
        }
        if (REFINE && lane == 0) {
            row_ms[0] = m;
            row_ms[1] = sum;
        }
    }
    if constexpr (REFINE) {
        // The row's final kL only (as softmax_topk refines its list): CANDS lm_head rows a row,
        // and the same candidates whatever the bucket's chunk count.
        __syncthreads();
        float m = row_ms[0], sum = row_ms[1];
        if (m != neg_inf())  // uniform: read from shared memory after the barrier
            refine_cands<kT>(win_v, win_c, 1, m, sum, x + (long long)i * HIDDEN, norm_w, lm_w);
        if (t < kK) emit(win_v[t], win_c[t], m, sum, hot_ids, probs, ids, (long long)i * kK + t);
    }
}

// Chunk ch of a row of kCols columns split in `chunks`: columns [c0, c1) (the header's W).
__device__ __forceinline__ void chunk_range(unsigned ch, unsigned chunks, long long& c0, long long& c1) {
    const long long w = (kCols + chunks - 1) / chunks;
    const long long width = (w + 3) / 4 * 4;
    c0 = (long long)ch * width < kCols ? (long long)ch * width : kCols;
    c1 = c0 + width < kCols ? c0 + width : kCols;
}

// Scans chunk ch of row i and writes its record at `rec` (the header's layout).
__device__ __forceinline__ void chunk_record(const float* logits, unsigned i, unsigned ch, unsigned chunks,
                                             const Lists& lists, float* rec) {
    long long c0, c1;
    chunk_range(ch, chunks, c0, c1);
    float m, sum;
    scan_range(logits + (long long)i * kCols, c0, c1, lists, m, sum);
    const int t = (int)threadIdx.x;
    if (t == 0) {
        rec[0] = m;
        rec[1] = sum;
    }
    if (t < kL) {
        const int c = lists.col(t, 0);
        const bool valid = c >= 0 && (long long)c < kCols;
        rec[2 + t] = valid ? lists.val(t, 0) : neg_inf();
        rec[2 + kL + t] = valid ? (float)(c + (long long)COL_OFFSET) : -1.0f;
    }
}

}  // namespace topk

// Two CTAs per SM (at most 64 registers a thread): the chunk rule's wave (facts::TOPK_WAVE)
// counts on it. (softmax_topk runs a CTA per row, at most a bucket's rows: no such bound.)
extern "C" __global__ void __launch_bounds__(TOPK_PARTIAL_THREADS, 2) topk_partial(TopkPartialParams p) {
    using namespace topk;
    extern __shared__ __align__(16) unsigned char topk_smem[];
    const Lists lists{reinterpret_cast<float*>(topk_smem),
                      reinterpret_cast<int*>(topk_smem + (long long)kL * kThreads * 4)};
    const unsigned i = blockIdx.x, ch = blockIdx.y;
    if (i >= p.batch || ch >= p.chunks) return;  // uniform per CTA
    chunk_record(p.logits, i, ch, p.chunks, lists, p.part + ((long long)i * p.chunks + ch) * (2 + 2 * kL));
}

extern "C" __global__ void __launch_bounds__(TOPK_MERGE_THREADS) topk_merge(TopkMergeParams p) {
    using namespace topk;
    constexpr int kR = 2 + 2 * kL;
    __shared__ float recs[32 * (kR + 1)];
    const unsigned i = blockIdx.x;
    // (chunks > 32 first: the product below is 32-bit and could wrap.)
    if (i >= p.batch || p.chunks == 0u || p.chunks > 32u || p.chunks * RANKS > 32u) return;  // uniform per CTA
    const int chunks = (int)p.chunks;
    const float* part = p.part;
    const unsigned batch = p.batch;
    // Record l = (rank l / chunks, chunk l % chunks) of row i.
    auto load = [&](int l, int f) {
        const int r = l / chunks, ch = l - r * chunks;
        return part[(((long long)r * batch + i) * chunks + ch) * kR + f];
    };
    merge_row<(int)TOPK_MERGE_THREADS>(i, chunks * kRanks, recs, load, p.hot_ids, p.probs, p.ids, p.x, p.norm_w,
                                       p.lm_w);
}

// topk_partial's records, then topk_merge's merge in the last of the row's CTAs to finish
// (docs/perf-notes.md item 38): one launch instead of two. Each CTA writes its record, and
// thread 0 fences it (release at device scope) and counts the CTA into the row's counter
// with atomicInc(.., chunks - 1), which wraps the word back to 0 at the last arrival: that
// CTA sees chunks - 1, fences again (acquire) and reads every record through L2 (__ldcg:
// other SMs wrote them, and a load through L1 or the read-only path could see a stale
// line). The counter is 0 again when the launch ends, as the
// next launch needs (kv.rs, COUNTER_WORDS). Unsharded rows only (RANKS = 1: a sharded plan's
// records meet after its all-gather).
namespace topk {

// topk_fused's CTA (RANKS = 1; see the entry).
__device__ __forceinline__ void fused_cta(const TopkFusedParams& p) {
    extern __shared__ __align__(16) unsigned char topk_smem[];
    const Lists lists{reinterpret_cast<float*>(topk_smem),
                      reinterpret_cast<int*>(topk_smem + (long long)kL * kThreads * 4)};
    const unsigned i = blockIdx.x, ch = blockIdx.y;
    // (chunks > 32: no merge could take the records; nothing is counted, nothing written.)
    if (i >= p.batch || ch >= p.chunks || p.chunks > 32u) return;  // uniform per CTA
    constexpr int kR = 2 + 2 * kL;
    chunk_record(p.logits, i, ch, p.chunks, lists, p.part + ((long long)i * p.chunks + ch) * kR);
    __shared__ unsigned last;
    // The record's writers meet thread 0 at the barrier; thread 0's fence then orders all of
    // their writes before its count (fences are cumulative over what the barrier made
    // visible to it), as its fence after the count orders the last CTA's reads after every
    // other CTA's count. One fence each way, in one thread: a fence is a MEMBAR.SC.GPU.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned prev = atomicInc(reinterpret_cast<unsigned*>(p.counters) + i, p.chunks - 1u);
        last = prev == p.chunks - 1u;
        if (last) __threadfence();
    }
    __syncthreads();
    if (!last) return;  // uniform per CTA
    // The lists are dead: their shared memory stages the records (kL * 4096 bytes of lists
    // against 32 * (kR + 1) floats of records: 384 + 256 * kL bytes).
    float* recs = reinterpret_cast<float*>(topk_smem);
    const float* part = p.part + (long long)i * p.chunks * kR;
    auto load = [&](int l, int f) { return __ldcg(part + (long long)l * kR + f); };
    merge_row<(int)TOPK_FUSED_THREADS>(i, (int)p.chunks, recs, load, p.hot_ids, p.probs, p.ids, p.x, p.norm_w,
                                       p.lm_w);
}

}  // namespace topk

extern "C" __global__ void __launch_bounds__(TOPK_FUSED_THREADS, 2) topk_fused(TopkFusedParams p) {
    static_assert(TOPK_FUSED_THREADS == TOPK_PARTIAL_THREADS, "the partial's lists and wave");
    // A sharded instance compiles (one module per template) but does nothing: validation
    // refuses its launch (a sharded row's records meet after the all-gather, in topk_merge).
    if constexpr (RANKS == 1u) topk::fused_cta(p);
}

extern "C" __global__ void __launch_bounds__(LOGITS_GATHER_THREADS) logits_gather(LogitsGatherParams p) {
    using namespace topk;
    const unsigned i = blockIdx.x, t = blockIdx.y;
    if (i >= p.batch || t >= RANKS) return;  // uniform per CTA
    const float* src = p.part + ((long long)t * p.batch + i) * kCols;
    float* dst = p.out + (long long)i * kAllCols + (long long)t * kCols;
    for (long long c = threadIdx.x; c < kCols; c += blockDim.x) dst[c] = src[c];
}
