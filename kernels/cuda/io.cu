// io.cu: the engine-memory step's prologue (admit) and epilogue (emit), and draft decode's
// (admit_decode, emit_decode). The runtime launches them around a bucket's launches when the
// caller's device tensors are the inputs; they are never in a plan's launch lists.
//
// Entry admit
//   Constants: act_t, HIDDEN, HIDDEN_IN, VOCAB, N, TOPK, PAGE_SIZE, MAX_CONTEXT, WINDOW (the
//              layers' read window, format::read_window)
//   Launch:    grid (batch, 1, 1), block (ADMIT_THREADS = 256, 1, 1), dynamic shared memory
//              admit_smem_bytes(batch, N) (entries/io.rs): the write set, HASH =
//              admit_hash_slots(batch, N) slots of a u32 key and a u32 owner pair, then
//              one rule byte per request. batch * N <= ADMIT_MAX_ROWS (8192).
//   Params (by value, natural C alignment, fields in this order):
//     src_ids     const long long*  [b, N]       the caller's token ids (int32 when flags has
//                                   ADMIT_FLAG_IDS_I32)
//     src_hidden  const act_t*      [b, N, HIDDEN_IN]   (HIDDEN_IN: the head's input width,
//                                   HIDDEN for EAGLE-1/2, 3 x the target's for EAGLE-3)
//     src_req     const long long*  [b]          page-table rows (int32 when flags bit 0)
//     src_prefix  const long long*  [b]          prefix lengths (int32 when flags bit 1)
//     src_accept  const long long*  [b]          accept lengths (int32 when flags bit 2); with
//                                   ADMIT_FLAG_SELECT the selected rows (base+i)*N + A - 1
//                                   instead (SGLang's select_index, vLLM's last_token_indices)
//     out_probs, out_ids, out_hidden, out_logits where emit copies the outputs (null: not)
//     ids, hidden, req_slots, prefix_lens, accept_lens   the bucket's input buffers
//     page_table  const int*        the registered table; kv_layout const long long* its words
//     status      long long*        the runtime's status words (kv.rs)
//     b, batch, flags, prefix_bias  real requests, bucket, flags (bits 0-2: int32 inputs;
//                                   ADMIT_FLAG_LAST: the step's last chunk; ADMIT_FLAG_IDS_I32;
//                                   ADMIT_FLAG_SELECT), added to prefixes (i32)
//     base, epoch   the step-wide index of request 0 (chunks), the step's status tag
//   Semantics. CTA i, request i. With r = src_req[i], L = src_prefix[i] + prefix_bias,
//   A = src_accept[i] (src_prefix and src_accept clamped to ±2^62 first), request i < b is
//   admitted when it passes, in order:
//     RULE_REQUEST  0 <= r < TABLE_ROWS
//     RULE_PREFIX   0 <= L and L + N <= MAX_CONTEXT
//     RULE_ROW      positions L .. L+N-1 lie in row r (token slots: L + N <= TABLE_COLS;
//                   page ids: ceil((L + N) / PAGE_SIZE) <= TABLE_COLS)
//     RULE_ACCEPT   1 <= A <= N
//     RULE_SLOT     each new position's token slot (common.cuh kv_token) is in the pool
//     RULE_ID       each src_ids[i][j] is in [0, VOCAB)
//     RULE_ALIAS    no token slot of positions 0 .. L+N-1 of row r is written by another
//                   (request, position) of this launch: W is the set of slots the requests
//                   j < b passing rules 1-6 write (their positions L_j .. L_j+N-1), each with
//                   its writers; request i is refused when a slot it reads has a writer
//                   other than i at that same position (two requests writing one slot, a
//                   request reading another's new slot, or one row mapping two positions
//                   to one slot). Every CTA builds W in shared memory (O(b N)) and probes
//                   its own row (O(L + N)).
//     RULE_SLOT     (again, in the same walk as RULE_ALIAS, so the request is still one of
//                   W's writers) each prefix position from max(0, L - WINDOW + 1) on
//                   (WINDOW: the layers' read window, 0 = all of it) has a token slot in the
//                   pool: the attention would read such a key as zeros. Reported before
//                   RULE_ALIAS.
//   Admitted: req_slots[i] = r, prefix_lens[i] = L, accept_lens[i] = A, ids and hidden rows
//   copied. Otherwise (and for i >= b, padding): req_slots[i] = -1 (no K/V read or written
//   anywhere), prefix 0, accept N, ids 0, hidden 0. A request i < b that broke rule R
//   counts in the status words, all tagged with the step (epoch << 32): STATUS_ERR_COUNT
//   holds the step's refused requests, STATUS_ERR_FIRST its lowest (base + i) << 8 | R,
//   STATUS_ERR_OTHER for RULE_ALIAS the lowest (base + i) << 16 | (base + writer) (16 bits
//   each, clamped); a word tagged with another step is replaced, not merged (no reset
//   between steps). CTA 0 writes b, the out pointers, the epoch (STATUS_STEP_EPOCH), base
//   and (on the step's last chunk, else 0) the mirror tag STATUS_EPOCH for emit.
//
// Entry emit
//   Constants: as admit, plus OUT_TOPK, OUT_LOGITS (the plan emits the top-K / the logits)
//              and COLS (columns of a logits row).
//   Launch:    grid (batch, EMIT_Y, 1), block (EMIT_THREADS = 256, 1, 1), no dynamic shared
//              memory; EMIT_Y = OUT_LOGITS ? clamp(ceil(COLS / 8192), 1, 32) : 1.
//   Params: req_slots int* [batch] (as admit wrote them),
//           probs const float* [batch, TOPK], ids const long long* [batch, TOPK] (null
//           without OUT_TOPK), hidden const act_t* [batch, HIDDEN], logits const float*
//           [batch, COLS] (null without OUT_LOGITS): the bucket's outputs;
//           status long long*, batch unsigned.
//   CTA (i, y), i < status[STATUS_STEP_B]: an admitted request (req_slots[i] >= 0) has its
//   rows copied to the status's out pointers (a null one is skipped), bit exact; a refused
//   one has them written as zeros (probabilities 0, ids 0, hidden 0, logits 0: a draft the
//   target rejects, never a stale row of another step). CTA y copies the y-th of EMIT_Y
//   equal slices of the logits row; CTA y = 0 the rest. Each CTA checks the values it
//   covers (in the bucket's buffers, whether copied or not) and, if one is not finite,
//   sets NON_FINITE_MARK in req_slots[i]. Every CTA then counts itself in
//   status[STATUS_EMIT_DONE]; the last one (after a fence) resets it to 0, folds the marked
//   requests into the refusal words as RULE_NONFINITE (count and lowest request, tagged
//   status[STATUS_STEP_EPOCH]) and, when status[STATUS_EPOCH] = e is not 0 (the step's last
//   chunk) and status[STATUS_MIRROR] is not null (host-mapped memory), writes the three
//   refusal words to words 1..3 of mirror slot e % MIRROR_SLOTS (MIRROR_WORDS each),
//   fences system-wide, then writes e to its word 0: the host polls finished steps there
//   without a copy or a wait.
//
// Entry admit_decode
//   Constants: as admit (N unused: draft decode's rows are lanes, S a launch argument).
//   Launch:    grid (batch, 1, 1), block (ADMIT_DECODE_THREADS = 256, 1, 1), dynamic shared
//              memory admit_decode_smem_bytes(batch, TOPK, steps) (entries/io_decode.rs):
//              the write set over HASH = admit_decode_hash_slots(..) slots, then one rule
//              byte per request. batch * TOPK * (steps - 1) <= ADMIT_MAX_ROWS.
//   Params: src_probs f32 [b, K], src_ids [b, K] (i64; int32 with ADMIT_FLAG_IDS_I32),
//           src_hidden act_t [b, HIDDEN], src_req / src_prefix / src_bonus [b] (i64; int32
//           with flags bit 0 / 1 / 2; src_bonus null unless the plan emits the verify
//           inputs), the bucket's probs, ids, hidden, req_slots, prefix_lens, bonus (null
//           with src_bonus), page_table, kv_layout, status; b, batch, flags, prefix_bias,
//           base, epoch as admit's; steps = S.
//   Semantics. CTA i, request i. With r = src_req[i], L = src_prefix[i] + prefix_bias
//   (src_prefix clamped to ±2^62 first), W_i = its lane positions L + lane_offset(L, k) + s
//   for lanes k < K and s < S - 1 (common.cuh), reach = lane_offset(L, K - 1) + S - 1,
//   request i < b is admitted when it passes, in order
//   (the CPU engine's admit_decode):
//     RULE_REQUEST  0 <= r < TABLE_ROWS
//     RULE_PREFIX   0 <= L and L + reach <= MAX_CONTEXT
//     RULE_ROW      L + reach fits row r (token slots: <= TABLE_COLS entries; page ids:
//                   ceil((L + reach) / PAGE_SIZE) <= TABLE_COLS)
//     RULE_SLOT     every position of W_i has a token slot in the pool (and, in the
//                   RULE_ALIAS walk, as admit's, every prefix position from
//                   max(0, L - WINDOW + 1) on)
//     RULE_ID       every src_ids[i][k] (and src_bonus[i]) is in [0, VOCAB)
//     RULE_ALIAS    no slot request i reads (its prefix 0 .. L-1 and W_i) is written by
//                   another (request, lane position) of this launch, over the write set of
//                   the requests passing rules 1-5 (as admit's, with W_i for the N new
//                   positions; the positions between page-aligned lane runs are neither
//                   read nor written).
//   Admitted: req_slots[i] = r, prefix_lens[i] = L, the probabilities, ids, hidden row and
//   bonus copied. Otherwise (and for i >= b): req_slots[i] = -1, everything else 0. The
//   status words as admit's (refusals tagged with the step; CTA 0 writes b, the epoch, base
//   and the mirror tag; no out pointers: emit_decode carries its own).
//
// Entry emit_decode
//   Constants: as admit.
//   Launch:    grid (batch, 1, 1), block (EMIT_DECODE_THREADS = 256, 1, 1), no dynamic shared
//              memory.
//   Params: req_slots int* [batch]; the bucket's parent_list [batch, pw], top_scores_index,
//           draft_tokens [batch, nodes], verify_tokens, verify_positions, retrieve_index,
//           retrieve_next_token, retrieve_next_sibling [batch, nodes + 1] (i64; null without
//           the verify inputs) and tree_mask i32 [batch, nodes + 1, nodes + 1]; the same nine
//           out_* destinations (null: not copied); status; batch, pw, nodes.
//   CTA i < status[STATUS_STEP_B]: an admitted request (req_slots[i] >= 0) has its rows copied
//   bit exact, a refused one has them written as zeros. Every CTA counts itself in
//   status[STATUS_EMIT_DONE]; the last one finishes as emit's does (the mirror; the trees are
//   integers, so nothing is flagged non-finite).
//
// Entry fill
//   Constants: none read (compiled with admit and emit).
//   Launch:    grid (min(ceil(width * height / FILL_THREADS), 1024), 1, 1), block
//              (FILL_THREADS = 256, 1, 1), no dynamic shared memory.
//   Params: dst int* (the region's first byte), value, elem_bytes (1, 2 or 4), width
//           (elements per row), height (rows), pitch (bytes between rows), all unsigned.
//   For r < height, c < width, the elem_bytes-byte element at dst + r*pitch + c*elem_bytes
//   gets the low elem_bytes bytes of value (a memset; the runtime launches it in place of
//   the memset nodes a GEMM library leaves in a captured graph). Another elem_bytes writes
//   nothing.
//
// Entry stage_in
//   Constants: none read (compiled with admit and emit).
//   Launch:    grid (stage_in_ctas(bucket's hidden vectors), 1, 1) (entries/io.rs), block
//              (STAGE_IN_THREADS = 256, 1, 1), no dynamic shared memory. The first node of an
//              owned-memory draft-extend graph; its parameters are set per step.
//   Params: src const int* (host-mapped: the staged integer inputs, ints_words words),
//           dst int* (the bucket's integer input buffers, the same words), ctl long long*
//           (host-mapped: [0] the step's sequence number, [1] the last consumed),
//           src_hidden const act_t* (the caller's device hidden states), hidden act_t* (the
//           bucket's), ints_words, hidden_vecs (16-byte vectors of hidden states; 0: none).
//   When ints_words > 0, CTA 0 copies dst[w] = src[w] for w < ints_words, reading the host's
//   memory afresh (__ldcv), then thread 0 writes ctl[1] = ctl[0] as read before the copy
//   (after a system-wide fence): once the host sees it, no read of the block is
//   outstanding. With ints_words = 0 (a replay on the inputs in place) neither. Every
//   CTA copies its grid-stride share of the hidden vectors, device to device, bit exact.
//
// Entry l2_prefetch
//   Constants: none read (compiled with admit and emit).
//   Launch:    grid (the runtime's CTAs, 1, 1), block (L2_PREFETCH_THREADS = 128, 1, 1), no
//              dynamic shared memory. A side branch of a captured graph (prefetch.rs in the
//              runtime): nothing waits on it.
//   Params: src const act_t* (a GEMM's weight, 16-byte aligned), chunks (4 KiB chunks).
//   Asks L2 for bytes [src, src + 4096 * chunks): chunk c by the thread c mod the grid's
//   threads, one cp.async.bulk.prefetch.L2 each (sm_90 and later; before that one
//   prefetch.global.L2 per 128-byte line). It writes nothing and does not wait for the data:
//   a prefetch is a hint, so no output of a step depends on whether it ran.
#include "common.cuh"

// AdmitParams, EmitParams and FillParams are declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

namespace io {

constexpr int kN = (int)N;
constexpr long long kH = (long long)HIDDEN;
constexpr long long kHin = (long long)HIDDEN_IN;
constexpr int kK = (int)TOPK;
static_assert(kN > 0 && kK > 0 && PAGE_SIZE > 0u, "N, TOPK and PAGE_SIZE are positive");

// Folds `value` into a status word tagged with this step: a word of another step is
// replaced; one of this step becomes fold(old, value). Refusals are rare: a CAS loop.
template <typename F>
__device__ void fold_tagged(long long* word, unsigned epoch, unsigned long long value, F fold) {
    auto* w = reinterpret_cast<unsigned long long*>(word);
    const unsigned long long tag = (unsigned long long)epoch << 32;
    unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(w), seen;
    do {
        seen = old;
        const unsigned long long next = (seen >> 32) == epoch ? tag | fold(seen & 0xffffffffull, value) : tag | value;
        old = atomicCAS(w, seen, next);
    } while (old != seen);
}

__device__ __forceinline__ long long load_int(const long long* p, long long i, bool is_i32) {
    return is_i32 ? (long long)reinterpret_cast<const int*>(p)[i] : p[i];
}

// A caller's integer clamped to ±2^62 (an int32 input is never touched): the sums admission
// makes with it (the prefix bias, N or a lane's reach, a select row's offset) cannot wrap an
// i64, and a clamped value still breaks the rule it is checked by. Without it a prefix of
// i64::MAX - 1 with bias 0 passed RULE_PREFIX (L + N wrapped negative, which C++ leaves
// undefined) and was refused by the slot loop as RULE_SLOT, the wrong rule.
__device__ __forceinline__ long long load_bounded(const long long* p, long long i, bool is_i32) {
    const long long lim = 1LL << 62;
    const long long x = load_int(p, i, is_i32);
    return x < -lim ? -lim : (x > lim ? lim : x);
}

// Whether x is finite (false for NaN and ±inf), without the math library.
__device__ __forceinline__ bool finite_f(float x) { return fabsf(x) <= 3.402823466e38f; }

__device__ __forceinline__ unsigned next_pow2(unsigned x) { return x <= 1u ? 1u : 1u << (32 - __clz(x - 1u)); }


// The oldest prefix position any layer's attention may read for a request with prefix L:
// all of it without a window, else L - WINDOW + 1 on (a row at L + j reads back to
// L + j - WINDOW + 1; draft decode's step s from L + s - WINDOW + 1). Conservative where a
// head's last layer attends from the selected row only (from L + A - WINDOW on): a hole
// between the two is refused though no layer of that head reads it.
__device__ __forceinline__ long long read_start(long long L) {
    return WINDOW > 0u ? max(0LL, L - (long long)WINDOW + 1) : 0;
}

// The rule a request of the launch ends with (0: admitted): the first of rules 1-6 it
// broke, else a prefix hole some layer reads (RULE_SLOT), else an alias (`other`: the lowest
// other writer of a slot it reads, 0xffff for none).
__device__ __forceinline__ int final_rule(bool real, int base_rule, bool hole, unsigned other) {
    if (!real) return 0;
    if (base_rule != 0) return base_rule;
    if (hole) return RULE_SLOT;
    return other != 0xffffu ? RULE_ALIAS : 0;
}

// A request's admission by rules 1-6: the rule it breaks (0: none) and its row, prefix and
// accept length. Serial over its N positions: one thread per request.
struct Admission {
    int rule;
    long long r, L, A;
};

__device__ Admission rule_of(const AdmitParams& p, const KvLayout& lay, unsigned j) {
    using namespace io;
    Admission q;
    q.rule = 0;
    q.r = load_int(p.src_req, j, (p.flags & 1u) != 0u);
    q.L = load_bounded(p.src_prefix, j, (p.flags & 2u) != 0u) + (long long)(int)p.prefix_bias;
    q.A = load_bounded(p.src_accept, j, (p.flags & 4u) != 0u);
    if ((p.flags & ADMIT_FLAG_SELECT) != 0u) q.A = q.A - ((long long)p.base + j) * kN + 1;
    const long long end = q.L + kN;  // one past the last new position
    const long long need = lay.mode == KV_MODE_TOKENS ? end : ceil_div(end, (long long)PAGE_SIZE);
    if (q.r < 0 || q.r >= lay.rows) q.rule = RULE_REQUEST;
    else if (q.L < 0 || end > (long long)MAX_CONTEXT) q.rule = RULE_PREFIX;
    else if (need > lay.cols) q.rule = RULE_ROW;
    else if (q.A < 1 || q.A > kN) q.rule = RULE_ACCEPT;
    if (q.rule != 0) return q;
    const int* row = kv_row(lay, p.page_table, q.r);
    for (int t = 0; t < kN; ++t) {
        if (kv_token(lay, row, q.L + t, (long long)PAGE_SIZE) < 0) {
            q.rule = RULE_SLOT;
            return q;
        }
    }
    const bool i32 = (p.flags & ADMIT_FLAG_IDS_I32) != 0u;
    for (int t = 0; t < kN; ++t) {
        const long long id = load_int(p.src_ids, (long long)j * kN + t, i32);
        if (id < 0 || id >= (long long)VOCAB) {
            q.rule = RULE_ID;
            return q;
        }
    }
    return q;
}

// The write set: open addressing over `slots` (a power of two) keys slot + 1 (0: empty),
// each with up to two writers (row j * N + t, 16 bits each; 0xffff: none). Two writers are
// enough to tell a request it is not alone on a slot and name one other.
struct WriteSet {
    unsigned* keys;
    unsigned* owners;
    unsigned mask;

    __device__ unsigned home(unsigned key) const { return (key * 2654435761u) & mask; }

    __device__ void insert(long long slot, unsigned writer) {
        const unsigned key = (unsigned)slot + 1u;
        for (unsigned h = home(key);; h = (h + 1u) & mask) {
            const unsigned prev = atomicCAS(keys + h, 0u, key);
            if (prev != 0u && prev != key) continue;
            const unsigned first = atomicCAS(owners + h, 0xffffffffu, 0xffff0000u | writer);
            if (first != 0xffffffffu && (first >> 16) == 0xffffu) {
                atomicCAS(owners + h, first, (writer << 16) | (first & 0xffffu));
            }
            return;
        }
    }

    // A writer of `slot` other than `mine` (0xffff: none).
    __device__ unsigned other(long long slot, unsigned mine) const {
        const unsigned key = (unsigned)slot + 1u;
        for (unsigned h = home(key);; h = (h + 1u) & mask) {
            const unsigned k = keys[h];
            if (k == 0u) return 0xffffu;
            if (k != key) continue;
            const unsigned o = owners[h], w1 = o & 0xffffu, w2 = o >> 16;
            if (w1 != 0xffffu && w1 != mine) return w1;
            if (w2 != 0xffffu && w2 != mine) return w2;
            return 0xffffu;
        }
    }
};

}  // namespace io

extern "C" __global__ void __launch_bounds__(ADMIT_THREADS) admit(AdmitParams p) {
    using namespace io;
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;  // uniform per CTA
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned hash = max(32u, next_pow2(2u * max(p.batch, 1u) * (unsigned)kN));
    WriteSet ws{reinterpret_cast<unsigned*>(smem), reinterpret_cast<unsigned*>(smem) + hash, hash - 1u};
    unsigned char* rules = smem + 8ull * hash;
    __shared__ long long s_req, s_len, s_acc;
    __shared__ unsigned s_other;
    const bool real = i < p.b;
    const KvLayout lay = kv_layout(p.kv_layout);
    for (unsigned h = threadIdx.x; h < hash; h += blockDim.x) {
        ws.keys[h] = 0u;
        ws.owners[h] = 0xffffffffu;
    }
    if (threadIdx.x == 0) s_other = 0xffffu;
    // Rules 1-6 for every request of the launch (each CTA needs all of them for W).
    for (unsigned j = threadIdx.x; j < p.b; j += blockDim.x) {
        const Admission q = rule_of(p, lay, j);
        rules[j] = (unsigned char)q.rule;
        if (j == i) {
            s_req = q.r;
            s_len = q.L;
            s_acc = q.A;
        }
    }
    if (threadIdx.x == 0 && i == 0) {
        p.status[STATUS_STEP_B] = p.b;
        p.status[STATUS_OUT_PROBS] = (long long)p.out_probs;
        p.status[STATUS_OUT_IDS] = (long long)p.out_ids;
        p.status[STATUS_OUT_HIDDEN] = (long long)p.out_hidden;
        p.status[STATUS_OUT_LOGITS] = (long long)p.out_logits;
        p.status[STATUS_STEP_EPOCH] = (long long)p.epoch;
        p.status[STATUS_BASE] = (long long)p.base;
        p.status[STATUS_EPOCH] = (p.flags & ADMIT_FLAG_LAST) != 0u ? (long long)p.epoch : 0;
    }
    __syncthreads();
    // W: the new slots of the requests passing rules 1-6, one (request, position) per thread.
    for (unsigned e = threadIdx.x; e < p.b * (unsigned)kN; e += blockDim.x) {
        const unsigned j = e / (unsigned)kN, t = e % (unsigned)kN;
        if (rules[j] != 0) continue;
        const long long r = load_int(p.src_req, j, (p.flags & 1u) != 0u);
        const long long L = load_bounded(p.src_prefix, j, (p.flags & 2u) != 0u) + (long long)(int)p.prefix_bias;
        ws.insert(kv_token(lay, kv_row(lay, p.page_table, r), L + t, (long long)PAGE_SIZE), e);
    }
    __syncthreads();
    // RULE_ALIAS: request i's reads, positions 0 .. L+N-1, against W; in the same walk,
    // RULE_SLOT for a prefix position some layer reads (from read_from on) without a slot.
    const int base_rule = real ? (int)rules[i] : 0;
    bool hole = false;  // this thread's positions: one without a slot that a layer reads
    if (real && base_rule == 0) {
        const int* row = kv_row(lay, p.page_table, s_req);
        const long long end = s_len + kN, read_from = read_start(s_len);
        for (long long q = threadIdx.x; q < end; q += blockDim.x) {
            const long long slot = kv_token(lay, row, q, (long long)PAGE_SIZE);
            if (slot < 0) {
                hole |= q >= read_from;
                continue;
            }
            const unsigned mine = q >= s_len ? i * (unsigned)kN + (unsigned)(q - s_len) : 0xffffu;
            const unsigned w = ws.other(slot, mine);
            if (w != 0xffffu) atomicMin(&s_other, w / (unsigned)kN);
        }
    }
    // Every thread of the CTA reaches this barrier (the walk's condition is the CTA's).
    const bool any_hole = __syncthreads_or(hole) != 0;
    const int rule = final_rule(real, base_rule, any_hole, s_other);
    const bool ok = real && rule == 0;
    if (threadIdx.x == 0) {
        if (real && rule != 0) {
            // 24 bits of request index (clamped) and 8 of rule under the 32-bit tag.
            const unsigned long long at = min((unsigned long long)p.base + i, 0xffffffull);
            fold_tagged(p.status + STATUS_ERR_COUNT, p.epoch, 1ull,
                        [](unsigned long long a, unsigned long long v) { return min(a + v, 0xffffffffull); });
            fold_tagged(p.status + STATUS_ERR_FIRST, p.epoch, (at << 8) | (unsigned long long)rule,
                        [](unsigned long long a, unsigned long long v) { return min(a, v); });
            if (rule == RULE_ALIAS) {
                const unsigned long long reader = min((unsigned long long)p.base + i, 0xffffull);
                const unsigned long long writer = min((unsigned long long)p.base + s_other, 0xffffull);
                fold_tagged(p.status + STATUS_ERR_OTHER, p.epoch, (reader << 16) | writer,
                            [](unsigned long long a, unsigned long long v) { return min(a, v); });
            }
        }
        p.req_slots[i] = ok ? (int)s_req : -1;
        p.prefix_lens[i] = ok ? (int)s_len : 0;
        p.accept_lens[i] = ok ? (int)s_acc : kN;
    }
    for (int j = (int)threadIdx.x; j < kN; j += (int)blockDim.x) {
        p.ids[(long long)i * kN + j] = ok ? load_int(p.src_ids, (long long)i * kN + j, (p.flags & ADMIT_FLAG_IDS_I32) != 0u) : 0;
    }
    act_t* dst = p.hidden + (long long)i * kN * kHin;
    if (ok) {
        block_copy_act(dst, p.src_hidden + (long long)i * kN * kHin, kN * kHin);
    } else {
        for (long long e = threadIdx.x; e < kN * kHin; e += blockDim.x) dst[e] = to_act(0.0f);
    }
}

namespace io {

// Copies (or zeroes) request i's outputs this CTA covers; returns whether a value it
// covers in the bucket's buffers is not finite (an admitted request's only).
__device__ bool emit_rows(const EmitParams& p, unsigned i, unsigned y) {
    const bool ok = p.req_slots[i] >= 0;
    bool bad = false;
    float* logits = reinterpret_cast<float*>(p.status[STATUS_OUT_LOGITS]);
    if (OUT_LOGITS && p.logits != nullptr) {
        const long long per = ceil_div((long long)COLS, (long long)gridDim.y);
        const long long lo = (long long)y * per, hi = min((long long)COLS, lo + per);
        const float* src = p.logits + (long long)i * COLS;
        for (long long c = lo + threadIdx.x; c < hi; c += blockDim.x) {
            const float v = ok ? src[c] : 0.0f;
            bad |= !finite_f(v);
            if (logits != nullptr) logits[(long long)i * COLS + c] = v;
        }
    }
    if (y != 0) return bad;
    float* probs = reinterpret_cast<float*>(p.status[STATUS_OUT_PROBS]);
    long long* ids = reinterpret_cast<long long*>(p.status[STATUS_OUT_IDS]);
    act_t* hidden = reinterpret_cast<act_t*>(p.status[STATUS_OUT_HIDDEN]);
    if (OUT_TOPK && p.probs != nullptr && p.ids != nullptr) {
        for (int k = (int)threadIdx.x; k < kK; k += (int)blockDim.x) {
            const float v = ok ? p.probs[(long long)i * kK + k] : 0.0f;
            bad |= !finite_f(v);
            if (probs != nullptr) probs[(long long)i * kK + k] = v;
            if (ids != nullptr) ids[(long long)i * kK + k] = ok ? p.ids[(long long)i * kK + k] : 0;
        }
    }
    const act_t* src = p.hidden + (long long)i * kH;
    if (ok) {
        for (long long e = threadIdx.x; e < kH; e += blockDim.x) bad |= !finite_f(to_f(src[e]));
        if (hidden != nullptr) block_copy_act(hidden + (long long)i * kH, src, kH);
    } else if (hidden != nullptr) {
        for (long long e = threadIdx.x; e < kH; e += blockDim.x) hidden[(long long)i * kH + e] = to_act(0.0f);
    }
    return bad;
}

// The last emit (or emit_decode) CTA: the flagged requests into the refusal words, then the
// mirror. `req_slots` and `batch` are the bucket's; `status` the runtime's words.
__device__ void emit_finish(int* req_slots, unsigned batch, long long* status) {
    struct {
        int* req_slots;
        unsigned batch;
        long long* status;
    } p{req_slots, batch, status};
    __shared__ unsigned s_count, s_first;
    if (threadIdx.x == 0) {
        s_count = 0u;
        s_first = 0xffffffffu;
    }
    __syncthreads();
    const long long b = min((long long)p.batch, p.status[STATUS_STEP_B]);
    const volatile int* slots = p.req_slots;
    for (long long j = threadIdx.x; j < b; j += blockDim.x) {
        const int v = slots[j];
        if (v >= 0 && (v & (int)NON_FINITE_MARK) != 0) {
            atomicAdd(&s_count, 1u);
            atomicMin(&s_first, (unsigned)j);
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    p.status[STATUS_EMIT_DONE] = 0;
    const unsigned epoch = (unsigned)p.status[STATUS_STEP_EPOCH];
    if (s_count != 0u) {
        const unsigned long long at = min((unsigned long long)p.status[STATUS_BASE] + s_first, 0xffffffull);
        const unsigned long long n = s_count;
        fold_tagged(p.status + STATUS_ERR_COUNT, epoch, n,
                    [](unsigned long long a, unsigned long long v) { return min(a + v, 0xffffffffull); });
        fold_tagged(p.status + STATUS_ERR_FIRST, epoch, (at << 8) | (unsigned long long)RULE_NONFINITE,
                    [](unsigned long long a, unsigned long long v) { return min(a, v); });
    }
    // Host memory mapped into the device: the words, a system-wide fence, then the tag, so
    // a host that sees the tag sees the words.
    volatile long long* mirror = reinterpret_cast<volatile long long*>(p.status[STATUS_MIRROR]);
    const long long e = p.status[STATUS_EPOCH];
    if (mirror != nullptr && e != 0) {
        volatile long long* slot = mirror + MIRROR_WORDS * (e % MIRROR_SLOTS);
        const volatile long long* st = p.status;
        slot[1] = st[STATUS_ERR_COUNT];
        slot[2] = st[STATUS_ERR_FIRST];
        slot[3] = st[STATUS_ERR_OTHER];
        __threadfence_system();
        slot[0] = e;
    }
}

}  // namespace io

extern "C" __global__ void __launch_bounds__(EMIT_THREADS) emit(EmitParams p) {
    using namespace io;
    const unsigned i = blockIdx.x, y = blockIdx.y;
    bool bad = false;
    if (i < p.batch && (long long)i < p.status[STATUS_STEP_B]) bad = emit_rows(p, i, y);  // uniform per CTA
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(reinterpret_cast<unsigned*>(p.req_slots + i), NON_FINITE_MARK);
    // The last CTA to finish sees every CTA's marks (each fenced them before counting).
    __shared__ bool s_last;
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long done = atomicAdd(reinterpret_cast<unsigned long long*>(p.status + STATUS_EMIT_DONE), 1ull);
        s_last = done + 1ull == (unsigned long long)gridDim.x * gridDim.y;
    }
    __syncthreads();
    if (s_last) {
        __threadfence();
        emit_finish(p.req_slots, p.batch, p.status);
    }
}

namespace io {

// Request j's lane position e (lane e / (S-1), forward e % (S-1)).
__device__ __forceinline__ long long lane_pos(long long L, unsigned e, unsigned steps) {
    const unsigned per = steps - 1u;
    return L + lane_offset(L, (int)(e / per), (int)steps, kK, (long long)PAGE_SIZE) + (long long)(e % per);
}

// A draft-decode request's admission by rules 1-5 (the rule it breaks, 0: none).
__device__ Admission rule_of_decode(const AdmitDecodeParams& p, const KvLayout& lay, unsigned j) {
    Admission q;
    q.rule = 0;
    q.A = 0;
    q.r = load_int(p.src_req, j, (p.flags & 1u) != 0u);
    q.L = load_bounded(p.src_prefix, j, (p.flags & 2u) != 0u) + (long long)(int)p.prefix_bias;
    const long long reach =
        lane_offset(q.L < 0 ? 0 : q.L, kK - 1, (int)p.steps, kK, (long long)PAGE_SIZE) + (long long)p.steps - 1;
    const long long end = q.L + reach;
    const long long need = lay.mode == KV_MODE_TOKENS ? end : ceil_div(end, (long long)PAGE_SIZE);
    if (q.r < 0 || q.r >= lay.rows) q.rule = RULE_REQUEST;
    else if (q.L < 0 || end > (long long)MAX_CONTEXT) q.rule = RULE_PREFIX;
    else if (need > lay.cols) q.rule = RULE_ROW;
    if (q.rule != 0) return q;
    const int* row = kv_row(lay, p.page_table, q.r);
    const unsigned writes = (unsigned)kK * (p.steps - 1u);
    for (unsigned e = 0; e < writes; ++e) {
        if (kv_token(lay, row, lane_pos(q.L, e, p.steps), (long long)PAGE_SIZE) < 0) {
            q.rule = RULE_SLOT;
            return q;
        }
    }
    const bool i32 = (p.flags & ADMIT_FLAG_IDS_I32) != 0u;
    for (int k = 0; k < kK; ++k) {
        const long long id = load_int(p.src_ids, (long long)j * kK + k, i32);
        if (id < 0 || id >= (long long)VOCAB) {
            q.rule = RULE_ID;
            return q;
        }
    }
    if (p.src_bonus != nullptr) {
        const long long t = load_int(p.src_bonus, j, (p.flags & 4u) != 0u);
        if (t < 0 || t >= (long long)VOCAB) q.rule = RULE_ID;
    }
    return q;
}

}  // namespace io

extern "C" __global__ void __launch_bounds__(ADMIT_DECODE_THREADS) admit_decode(AdmitDecodeParams p) {
    using namespace io;
    const unsigned i = blockIdx.x;
    if (i >= p.batch || p.steps < 2u) return;  // uniform per CTA
    const unsigned writes = (unsigned)kK * (p.steps - 1u);
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned hash = max(32u, next_pow2(2u * max(p.batch, 1u) * writes));
    WriteSet ws{reinterpret_cast<unsigned*>(smem), reinterpret_cast<unsigned*>(smem) + hash, hash - 1u};
    unsigned char* rules = smem + 8ull * hash;
    __shared__ long long s_req, s_len;
    __shared__ unsigned s_other;
    const bool real = i < p.b;
    const KvLayout lay = kv_layout(p.kv_layout);
    for (unsigned h = threadIdx.x; h < hash; h += blockDim.x) {
        ws.keys[h] = 0u;
        ws.owners[h] = 0xffffffffu;
    }
    if (threadIdx.x == 0) s_other = 0xffffu;
    for (unsigned j = threadIdx.x; j < p.b; j += blockDim.x) {
        const Admission q = rule_of_decode(p, lay, j);
        rules[j] = (unsigned char)q.rule;
        if (j == i) {
            s_req = q.r;
            s_len = q.L;
        }
    }
    if (threadIdx.x == 0 && i == 0) {
        p.status[STATUS_STEP_B] = p.b;
        p.status[STATUS_STEP_EPOCH] = (long long)p.epoch;
        p.status[STATUS_BASE] = (long long)p.base;
        p.status[STATUS_EPOCH] = (p.flags & ADMIT_FLAG_LAST) != 0u ? (long long)p.epoch : 0;
    }
    __syncthreads();
    // W: the lane slots of the requests passing rules 1-5, one (request, lane position) per
    // thread; writer e = j * writes + lane position.
    for (unsigned e = threadIdx.x; e < p.b * writes; e += blockDim.x) {
        const unsigned j = e / writes, t = e % writes;
        if (rules[j] != 0) continue;
        const long long r = load_int(p.src_req, j, (p.flags & 1u) != 0u);
        const long long L = load_bounded(p.src_prefix, j, (p.flags & 2u) != 0u) + (long long)(int)p.prefix_bias;
        ws.insert(kv_token(lay, kv_row(lay, p.page_table, r), lane_pos(L, t, p.steps), (long long)PAGE_SIZE), e);
    }
    __syncthreads();
    // RULE_ALIAS: request i's reads (its prefix, then its own lane slots) against W; in the
    // same walk, RULE_SLOT for a prefix position some layer reads without a slot.
    const int base_rule = real ? (int)rules[i] : 0;
    bool hole = false;  // this thread's prefix positions: one without a slot that a layer reads
    if (real && base_rule == 0) {
        const int* row = kv_row(lay, p.page_table, s_req);
        const long long read_from = read_start(s_len);
        for (long long q = threadIdx.x; q < s_len + (long long)writes; q += blockDim.x) {
            const bool own = q >= s_len;
            const long long pos = own ? lane_pos(s_len, (unsigned)(q - s_len), p.steps) : q;
            const long long slot = kv_token(lay, row, pos, (long long)PAGE_SIZE);
            if (slot < 0) {
                hole |= !own && q >= read_from;
                continue;
            }
            const unsigned mine = own ? i * writes + (unsigned)(q - s_len) : 0xffffu;
            const unsigned w = ws.other(slot, mine);
            if (w != 0xffffu) atomicMin(&s_other, w / writes);
        }
    }
    // Every thread of the CTA reaches this barrier (the walk's condition is the CTA's).
    const bool any_hole = __syncthreads_or(hole) != 0;
    const int rule = final_rule(real, base_rule, any_hole, s_other);
    const bool ok = real && rule == 0;
    if (threadIdx.x == 0) {
        if (real && rule != 0) {
            const unsigned long long at = min((unsigned long long)p.base + i, 0xffffffull);
            fold_tagged(p.status + STATUS_ERR_COUNT, p.epoch, 1ull,
                        [](unsigned long long a, unsigned long long v) { return min(a + v, 0xffffffffull); });
            fold_tagged(p.status + STATUS_ERR_FIRST, p.epoch, (at << 8) | (unsigned long long)rule,
                        [](unsigned long long a, unsigned long long v) { return min(a, v); });
            if (rule == RULE_ALIAS) {
                const unsigned long long reader = min((unsigned long long)p.base + i, 0xffffull);
                const unsigned long long writer = min((unsigned long long)p.base + s_other, 0xffffull);
                fold_tagged(p.status + STATUS_ERR_OTHER, p.epoch, (reader << 16) | writer,
                            [](unsigned long long a, unsigned long long v) { return min(a, v); });
            }
        }
        p.req_slots[i] = ok ? (int)s_req : -1;
        p.prefix_lens[i] = ok ? (int)s_len : 0;
        if (p.bonus != nullptr) p.bonus[i] = ok && p.src_bonus != nullptr ? load_int(p.src_bonus, i, (p.flags & 4u) != 0u) : 0;
    }
    const bool i32 = (p.flags & ADMIT_FLAG_IDS_I32) != 0u;
    for (int k = (int)threadIdx.x; k < kK; k += (int)blockDim.x) {
        const long long e = (long long)i * kK + k;
        p.probs[e] = ok ? p.src_probs[e] : 0.0f;
        p.ids[e] = ok ? load_int(p.src_ids, e, i32) : 0;
    }
    act_t* dst = p.hidden + (long long)i * kH;
    if (ok) {
        block_copy_act(dst, p.src_hidden + (long long)i * kH, kH);
    } else {
        for (long long e = threadIdx.x; e < kH; e += blockDim.x) dst[e] = to_act(0.0f);
    }
}

namespace io {

// Row i of a [batch, w] tensor: copied from src (admitted) or zeros, to dst (null: skipped).
template <typename T>
__device__ __forceinline__ void emit_row(T* dst, const T* src, long long w, unsigned i, bool ok) {
    if (dst == nullptr || src == nullptr) return;
    for (long long e = threadIdx.x; e < w; e += blockDim.x) dst[(long long)i * w + e] = ok ? src[(long long)i * w + e] : T(0);
}

}  // namespace io

extern "C" __global__ void __launch_bounds__(EMIT_DECODE_THREADS) emit_decode(EmitDecodeParams p) {
    using namespace io;
    const unsigned i = blockIdx.x;
    if (i < p.batch && (long long)i < p.status[STATUS_STEP_B]) {  // uniform per CTA
        const bool ok = p.req_slots[i] >= 0;
        const long long n = (long long)p.nodes + 1;
        emit_row(p.out_parent_list, p.parent_list, (long long)p.pw, i, ok);
        emit_row(p.out_top_scores_index, p.top_scores_index, (long long)p.nodes, i, ok);
        emit_row(p.out_draft_tokens, p.draft_tokens, (long long)p.nodes, i, ok);
        emit_row(p.out_verify_tokens, p.verify_tokens, n, i, ok);
        emit_row(p.out_verify_positions, p.verify_positions, n, i, ok);
        emit_row(p.out_retrieve_index, p.retrieve_index, n, i, ok);
        emit_row(p.out_retrieve_next_token, p.retrieve_next_token, n, i, ok);
        emit_row(p.out_retrieve_next_sibling, p.retrieve_next_sibling, n, i, ok);
        emit_row(p.out_tree_mask, p.tree_mask, n * n, i, ok);
    }
    __syncthreads();
    __shared__ bool s_last;
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long done = atomicAdd(reinterpret_cast<unsigned long long*>(p.status + STATUS_EMIT_DONE), 1ull);
        s_last = done + 1ull == (unsigned long long)gridDim.x;
    }
    __syncthreads();
    if (s_last) {
        __threadfence();
        emit_finish(p.req_slots, p.batch, p.status);
    }
}

extern "C" __global__ void __launch_bounds__(FILL_THREADS) fill(FillParams p) {
    const unsigned long long n = (unsigned long long)p.width * p.height;
    unsigned char* base = reinterpret_cast<unsigned char*>(p.dst);
    for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = e / p.width, c = e % p.width;
        unsigned char* at = base + r * p.pitch + c * p.elem_bytes;
        if (p.elem_bytes == 4u) {
            *reinterpret_cast<unsigned*>(at) = p.value;
        } else if (p.elem_bytes == 2u) {
            *reinterpret_cast<unsigned short*>(at) = (unsigned short)p.value;
        } else if (p.elem_bytes == 1u) {
            *at = (unsigned char)p.value;
        }
    }
}

extern "C" __global__ void __launch_bounds__(STAGE_IN_THREADS) stage_in(StageInParams p) {
    // No integer words (a replay on the inputs in place): the block is not read, so its
    // sequence number is not reported either (it may already name a later step's rows).
    if (blockIdx.x == 0 && p.ints_words > 0u) {
        // The sequence number first (thread 0 reports it): the host wrote it with the
        // inputs, before the launch.
        const long long seq = threadIdx.x == 0 ? __ldcv(p.ctl) : 0;
        const unsigned long long words = p.ints_words;
        const int* src = p.src;
        int* dst = p.dst;
        unsigned long long done = 0;
        if (aligned16(src) && aligned16(dst)) {
            const unsigned long long nv = words / 4;
            for (unsigned long long v = threadIdx.x; v < nv; v += 4ull * blockDim.x) {
                int4 r[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const unsigned long long at = v + (unsigned long long)q * blockDim.x;
                    r[q] = at < nv ? __ldcv(reinterpret_cast<const int4*>(src) + at) : make_int4(0, 0, 0, 0);
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const unsigned long long at = v + (unsigned long long)q * blockDim.x;
                    if (at < nv) reinterpret_cast<int4*>(dst)[at] = r[q];
                }
            }
            done = nv * 4;
        }
        for (unsigned long long w = done + threadIdx.x; w < words; w += blockDim.x) dst[w] = __ldcv(src + w);
        // Every load of the block has returned (each value was stored above).
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            *reinterpret_cast<volatile long long*>(p.ctl + 1) = seq;
        }
    }
    copy16_strided(reinterpret_cast<uint4*>(p.hidden), reinterpret_cast<const uint4*>(p.src_hidden), p.hidden_vecs,
                   (long long)blockIdx.x * blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x);
}

extern "C" __global__ void __launch_bounds__(L2_PREFETCH_THREADS) l2_prefetch(L2PrefetchParams p) {
    const char* base = reinterpret_cast<const char*>(p.src);
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long c = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; c < p.chunks; c += step) {
        const char* at = base + c * 4096ull;
#if __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(at), "r"(4096u) : "memory");
#else
#pragma unroll 4
        for (int line = 0; line < 32; ++line) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(at + line * 128));
#endif
    }
}
