// io.cu: the engine-memory step's prologue (admit) and epilogue (emit). The runtime launches
// them around a bucket's launches when the caller's device tensors are the inputs; they are
// never in a plan's launch lists.
//
// Entry admit
//   Constants: act_t, HIDDEN, HIDDEN_IN, VOCAB, N, TOPK, PAGE_SIZE, MAX_CONTEXT
//   Launch:    grid (batch, 1, 1), block (ADMIT_THREADS = 256, 1, 1), no dynamic shared memory.
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
//   A = src_accept[i], request i < b is admitted when it passes, in order:
//     RULE_REQUEST  0 <= r < TABLE_ROWS
//     RULE_PREFIX   0 <= L and L + N <= MAX_CONTEXT
//     RULE_ROW      positions L .. L+N-1 lie in row r (token slots: L + N <= TABLE_COLS;
//                   page ids: ceil((L + N) / PAGE_SIZE) <= TABLE_COLS)
//     RULE_ACCEPT   1 <= A <= N
//     RULE_SLOT     each new position's token slot (common.cuh kv_token) is in the pool
//     RULE_ID       each src_ids[i][j] is in [0, VOCAB)
//   Admitted: req_slots[i] = r, prefix_lens[i] = L, accept_lens[i] = A, ids and hidden rows
//   copied. Otherwise (and for i >= b, padding): req_slots[i] = -1 (no K/V read or written
//   anywhere), prefix 0, accept N, ids 0, hidden 0. A request i < b that broke rule R
//   counts in the status words, both tagged with the step (epoch << 32): STATUS_ERR_COUNT
//   holds the step's refused requests, STATUS_ERR_FIRST its lowest (base + i) << 8 | R; a
//   word tagged with another step is replaced, not merged (no reset between steps).
//   CTA 0 writes b, the out pointers and (on the step's last chunk, else 0) the epoch to the
//   status words for emit.
//
// Entry emit
//   Constants: as admit, plus OUT_TOPK, OUT_LOGITS (the plan emits the top-K / the logits)
//              and COLS (columns of a logits row).
//   Launch:    grid (batch, EMIT_Y, 1), block (EMIT_THREADS = 256, 1, 1), no dynamic shared
//              memory; EMIT_Y = OUT_LOGITS ? clamp(ceil(COLS / 8192), 1, 32) : 1.
//   Params: req_slots const int* [batch] (as admit wrote them),
//           probs const float* [batch, TOPK], ids const long long* [batch, TOPK] (null
//           without OUT_TOPK), hidden const act_t* [batch, HIDDEN], logits const float*
//           [batch, COLS] (null without OUT_LOGITS): the bucket's outputs;
//           status long long*, batch unsigned.
//   CTA (i, y), i < status[STATUS_STEP_B]: an admitted request (req_slots[i] >= 0) has its
//   rows copied to the status's out pointers (a null one is skipped), bit exact; a refused
//   one has them written as zeros (probabilities 0, ids 0, hidden 0, logits 0: a draft the
//   target rejects, never a stale row of another step). CTA y copies the y-th of EMIT_Y
//   equal slices of the logits row; CTA y = 0 the rest. When status[STATUS_EPOCH] = e is
//   not 0 (the step's last chunk) and status[STATUS_MIRROR] is not null (host-mapped
//   memory), CTA (0, 0) writes the two refusal words (STATUS_ERR_COUNT, STATUS_ERR_FIRST)
//   to words 1, 2 of mirror slot e % MIRROR_SLOTS, fences system-wide, then writes e to its
//   word 0: the host polls finished steps there without a copy or a wait.
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

}  // namespace io

extern "C" __global__ void __launch_bounds__(ADMIT_THREADS) admit(AdmitParams p) {
    using namespace io;
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;  // uniform per CTA
    __shared__ int s_rule;
    __shared__ long long s_req, s_len, s_acc;
    const bool real = i < p.b;
    const KvLayout lay = kv_layout(p.kv_layout);
    if (threadIdx.x == 0) {
        int rule = 0;
        long long r = -1, L = 0, A = kN;
        if (real) {
            r = load_int(p.src_req, i, (p.flags & 1u) != 0u);
            L = load_int(p.src_prefix, i, (p.flags & 2u) != 0u) + (long long)(int)p.prefix_bias;
            A = load_int(p.src_accept, i, (p.flags & 4u) != 0u);
            if ((p.flags & ADMIT_FLAG_SELECT) != 0u) A = A - ((long long)p.base + i) * kN + 1;
            const long long end = L + kN;  // one past the last new position
            const long long need = lay.mode == KV_MODE_TOKENS ? end : ceil_div(end, (long long)PAGE_SIZE);
            if (r < 0 || r >= lay.rows) rule = RULE_REQUEST;
            else if (L < 0 || end > (long long)MAX_CONTEXT) rule = RULE_PREFIX;
            else if (need > lay.cols) rule = RULE_ROW;
            else if (A < 1 || A > kN) rule = RULE_ACCEPT;
        }
        s_rule = rule;
        s_req = r;
        s_len = L;
        s_acc = A;
        if (i == 0) {
            p.status[STATUS_STEP_B] = p.b;
            p.status[STATUS_OUT_PROBS] = (long long)p.out_probs;
            p.status[STATUS_OUT_IDS] = (long long)p.out_ids;
            p.status[STATUS_OUT_HIDDEN] = (long long)p.out_hidden;
            p.status[STATUS_OUT_LOGITS] = (long long)p.out_logits;
            p.status[STATUS_EPOCH] = (p.flags & ADMIT_FLAG_LAST) != 0u ? (long long)p.epoch : 0;
        }
    }
    __syncthreads();
    // The new positions' slots and the ids, one thread per row (rules RULE_SLOT, RULE_ID).
    bool bad_slot = false, bad_id = false;
    const bool checks = real && s_rule == 0;
    if (checks && (int)threadIdx.x < kN) {
        const int j = (int)threadIdx.x;
        const int* row = kv_row(lay, p.page_table, s_req);
        bad_slot = kv_token(lay, row, s_len + j, (long long)PAGE_SIZE) < 0;
        const long long id = load_int(p.src_ids, (long long)i * kN + j, (p.flags & ADMIT_FLAG_IDS_I32) != 0u);
        bad_id = id < 0 || id >= (long long)VOCAB;
    }
    const int any_slot = __syncthreads_or(bad_slot);
    const int any_id = __syncthreads_or(bad_id);
    const int rule = s_rule != 0 ? s_rule : (any_slot ? RULE_SLOT : (any_id ? RULE_ID : 0));
    const bool ok = real && rule == 0;
    if (threadIdx.x == 0) {
        if (real && rule != 0) {
            // 24 bits of request index (clamped) and 8 of rule under the 32-bit tag.
            const unsigned long long at = min((unsigned long long)p.base + i, 0xffffffull);
            fold_tagged(p.status + STATUS_ERR_COUNT, p.epoch, 1ull,
                        [](unsigned long long a, unsigned long long v) { return min(a + v, 0xffffffffull); });
            fold_tagged(p.status + STATUS_ERR_FIRST, p.epoch, (at << 8) | (unsigned long long)rule,
                        [](unsigned long long a, unsigned long long v) { return min(a, v); });
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

extern "C" __global__ void __launch_bounds__(EMIT_THREADS) emit(EmitParams p) {
    using namespace io;
    const unsigned i = blockIdx.x, y = blockIdx.y;
    if (i == 0 && y == 0 && threadIdx.x == 0) {
        // Host memory mapped into the device: the words, a system-wide fence, then the tag,
        // so a host that sees the tag sees the words. admit (the previous launch) wrote the
        // status words; this step's refusals are final.
        volatile long long* mirror = reinterpret_cast<volatile long long*>(p.status[STATUS_MIRROR]);
        const long long e = p.status[STATUS_EPOCH];
        if (mirror != nullptr && e != 0) {
            volatile long long* slot = mirror + 3 * (e % MIRROR_SLOTS);
            slot[1] = p.status[STATUS_ERR_COUNT];
            slot[2] = p.status[STATUS_ERR_FIRST];
            __threadfence_system();
            slot[0] = e;
        }
    }
    if (i >= p.batch || (long long)i >= p.status[STATUS_STEP_B]) return;  // uniform per CTA
    const bool ok = p.req_slots[i] >= 0;
    float* logits = reinterpret_cast<float*>(p.status[STATUS_OUT_LOGITS]);
    if (OUT_LOGITS && logits != nullptr && p.logits != nullptr) {
        const long long per = ceil_div((long long)COLS, (long long)gridDim.y);
        const long long lo = (long long)y * per, hi = min((long long)COLS, lo + per);
        float* dst = logits + (long long)i * COLS;
        const float* src = p.logits + (long long)i * COLS;
        for (long long c = lo + threadIdx.x; c < hi; c += blockDim.x) dst[c] = ok ? src[c] : 0.0f;
    }
    if (y != 0) return;
    float* probs = reinterpret_cast<float*>(p.status[STATUS_OUT_PROBS]);
    long long* ids = reinterpret_cast<long long*>(p.status[STATUS_OUT_IDS]);
    act_t* hidden = reinterpret_cast<act_t*>(p.status[STATUS_OUT_HIDDEN]);
    if (OUT_TOPK && p.probs != nullptr && p.ids != nullptr) {
        for (int k = (int)threadIdx.x; k < kK; k += (int)blockDim.x) {
            if (probs != nullptr) probs[(long long)i * kK + k] = ok ? p.probs[(long long)i * kK + k] : 0.0f;
            if (ids != nullptr) ids[(long long)i * kK + k] = ok ? p.ids[(long long)i * kK + k] : 0;
        }
    }
    if (hidden != nullptr) {
        if (ok) {
            block_copy_act(hidden + (long long)i * kH, p.hidden + (long long)i * kH, kH);
        } else {
            for (long long e = threadIdx.x; e < kH; e += blockDim.x) hidden[(long long)i * kH + e] = to_act(0.0f);
        }
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
