// tree.cu: draft decode's top-K tree, as SGLang 0.5.23 grows it between its draft forwards
// (srt/speculative/spec_utils.py select_top_k_tokens, eagle_utils.py organize_draft_results),
// and the row gather that gives each lane its parent's hidden state.
//
// Notation: K = TOPK lanes per request, S = LANE_STEPS, N = DRAFT_TOKENS,
// C = K + (S-1)*K*K entries in the score and token lists, PW = (S-1)*K + 1 parents.
// Score index s < K: draft-extend candidate s (a root child); s = K + (i-1)*K*K + p*K + c:
// the c-th top-K candidate of lane p after forward i-1 (i in [1, S-1]). Order of two
// candidates: the larger value first, NaN above every number (torch.topk's order), equal
// values by the lower index (the release leaves ties to torch; it keeps the lowest-index set
// on the H200).
//
// Entry tree_init      grid (batch), block (TREE_INIT_THREADS = 256), no dynamic shared memory
//   scores[r,k] = topk_probs[r,k]; ids[r*K+k] = topk_ids[r,k]; src[r*K+k] = r (when src is
//   not null); score_list[r,k] = topk_probs[r,k]; token_list[r,k] = topk_ids[r,k];
//   parent_list[r,t] = t - 1 for t in [0, K].
// Entry tree_select    (STEP = i in [1, S-1]) grid (batch), block (TREE_SELECT_THREADS = 256)
//   e[p*K+c] = scores[r,p] * probs[r*K+p, c] (fp32 product); score_list[r, K+(i-1)K²+p*K+c] = e,
//   token_list[...] = ids[r*K+p, c]; sel[0..K) = the K best of e (in that order);
//   scores_out[r,k] = e[sel[k]], next_ids[r*K+k] = ids[r*K + sel[k]/K, sel[k]%K],
//   src[r*K+k] = r*K + sel[k]/K, parent_list[r, K+1+(i-1)*K+k] = sel[k] + K²(i-1) + K;
//   each output only when its pointer is not null (the last step writes the lists only).
// Entry tree_finish    grid (batch), block (TREE_FINISH_THREADS = 256)
//   the N-1 best of score_list[r, 0..C) in ascending index order -> top_scores_index[r, :],
//   their token_list entries -> draft_tokens[r, :].
// Entry tree_verify    grid (batch), block (TREE_VERIFY_THREADS = 256), no dynamic shared memory
//   (a draft-decode phase compiled with draft_decode_outputs = "tree,verify"). Node 0 is the
//   root, bonus_tokens[r], at position L = prefix_lens[r]; node j in [1, N) is score index
//   s_j = top_scores_index[r, j-1] with token draft_tokens[r, j-1]. Its parent: node 0 when
//   s_j / K == 0, else the node whose score index is parent_list[r, s_j / K] (node 0 when
//   none is: only at exact ties or NaN). tokens[r, j], positions[r, j] = L + depth(j),
//   retrieve_index[r, j] = r*N + j, next_token[r, j] = its lowest child (-1: none),
//   next_sibling[r, j] = the next higher node with its parent (-1: none),
//   mask[r, j, j'] = 1 iff j' is j or an ancestor of j (SGLang's QLEN_ONLY tree mask).
// Entry gather_rows    grid (rows), block (GATHER_ROWS_THREADS = 256)
//   out[z, :] = x[src[z], :] (HIDDEN act_t), bit exact; a source outside [0, src_rows) reads
//   row 0.
// Constants: act_t, HIDDEN, TOPK, LANE_STEPS, DRAFT_TOKENS, STEP.
// Params: as declared in specplan_kernels::entries::tree (the generated prelude).
#include "common.cuh"

namespace tree {

constexpr int kK = (int)TOPK;
constexpr int kS = (int)LANE_STEPS > 1 ? (int)LANE_STEPS : 1;
constexpr int kN = (int)DRAFT_TOKENS;
constexpr int kKK = kK * kK;
constexpr int kC = kK + (kS - 1) * kKK;
constexpr int kPW = (kS - 1) * kK + 1;
constexpr int kStep = (int)STEP;
static_assert(kK >= 1 && kK <= 32, "TOPK must be in [1, 32]");
static_assert(kC <= 4096, "the score list must fit the CTA's shared memory (MAX_TREE_CANDIDATES)");

// Whether candidate (va, ia) comes before (vb, ib).
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ia < ib);
    return va > vb || (va == vb && ia < ib);
}

}  // namespace tree

extern "C" __global__ void __launch_bounds__(TREE_INIT_THREADS) tree_init(TreeInitParams p) {
    using namespace tree;
    const unsigned r = blockIdx.x;
    if (r >= p.batch) return;
    for (int k = threadIdx.x; k < kK; k += blockDim.x) {
        const long long z = (long long)r * kK + k;
        const float pr = p.topk_probs[z];
        const long long id = p.topk_ids[z];
        p.scores[z] = pr;
        p.ids[z] = id;
        if (p.src != nullptr) p.src[z] = (int)r;
        p.score_list[(long long)r * kC + k] = pr;
        p.token_list[(long long)r * kC + k] = id;
    }
    for (int t = threadIdx.x; t <= kK; t += blockDim.x) p.parent_list[(long long)r * kPW + t] = t - 1;
}

extern "C" __global__ void __launch_bounds__(TREE_SELECT_THREADS) tree_select(TreeSelectParams p) {
    using namespace tree;
    __shared__ float sv[kKK];
    __shared__ int sel[kK];
    const unsigned r = blockIdx.x;
    if (r >= p.batch) return;  // uniform per CTA
    const long long base = (long long)r * kC + kK + (long long)(kStep - 1) * kKK;
    for (int c = threadIdx.x; c < kKK; c += blockDim.x) {
        const long long z = (long long)r * kK + c / kK;
        const float v = p.scores[z] * p.probs[z * kK + c % kK];
        sv[c] = v;
        p.score_list[base + c] = v;
        p.token_list[base + c] = p.ids[z * kK + c % kK];
    }
    __syncthreads();
    // Ranks are a permutation (`before` is a strict total order), so sel[0..K) is filled.
    for (int c = threadIdx.x; c < kKK; c += blockDim.x) {
        const float v = sv[c];
        int rank = 0;
        for (int o = 0; o < kKK; ++o) rank += tree::before(sv[o], o, v, c) ? 1 : 0;
        if (rank < kK) sel[rank] = c;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < kK; k += blockDim.x) {
        const int c = sel[k];
        const long long z = (long long)r * kK + k;
        const long long from = (long long)r * kK + c / kK;
        if (p.scores_out != nullptr) p.scores_out[z] = sv[c];
        if (p.next_ids != nullptr) p.next_ids[z] = p.ids[from * kK + c % kK];
        if (p.src != nullptr) p.src[z] = (int)from;
        if (p.parent_list != nullptr)
            p.parent_list[(long long)r * kPW + kK + 1 + (kStep - 1) * kK + k] = c + (long long)kKK * (kStep - 1) + kK;
    }
}

extern "C" __global__ void __launch_bounds__(TREE_FINISH_THREADS) tree_finish(TreeFinishParams p) {
    using namespace tree;
    __shared__ float sv[kC];
    __shared__ unsigned char chosen[kC];
    const unsigned r = blockIdx.x;
    if (r >= p.batch) return;  // uniform per CTA
    constexpr int kNodes = kN - 1;
    const float* row = p.score_list + (long long)r * kC;
    for (int c = threadIdx.x; c < kC; c += blockDim.x) sv[c] = row[c];
    __syncthreads();
    for (int c = threadIdx.x; c < kC; c += blockDim.x) {
        const float v = sv[c];
        int rank = 0;
        for (int o = 0; o < kC && rank < kNodes; ++o) rank += tree::before(sv[o], o, v, c) ? 1 : 0;
        chosen[c] = rank < kNodes ? 1 : 0;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < kC; c += blockDim.x) {
        if (!chosen[c]) continue;
        int at = 0;
        for (int o = 0; o < c; ++o) at += chosen[o];
        p.top_scores_index[(long long)r * kNodes + at] = c;
        p.draft_tokens[(long long)r * kNodes + at] = p.token_list[(long long)r * kC + c];
    }
}

extern "C" __global__ void __launch_bounds__(TREE_VERIFY_THREADS) tree_verify(TreeVerifyParams p) {
    using namespace tree;
    static_assert(kN >= 1 && kN <= 4097, "DRAFT_TOKENS must fit the CTA's shared memory");
    __shared__ int sel[kN];  // score indices < MAX_TREE_CANDIDATES
    __shared__ int par[kN];
    const unsigned r = blockIdx.x;
    if (r >= p.batch) return;  // uniform per CTA
    constexpr int kNodes = kN - 1;
    const long long nb = (long long)r * kN;
    for (int j = threadIdx.x; j < kNodes; j += blockDim.x) sel[j] = (int)p.top_scores_index[(long long)r * kNodes + j];
    __syncthreads();
    for (int j = threadIdx.x; j < kN; j += blockDim.x) {
        int q = 0;
        if (j > 0) {
            const int tb = sel[j - 1] / kK;
            if (tb > 0 && tb < kPW) {
                const long long target = p.parent_list[(long long)r * kPW + tb];
                for (int o = 0; o < kNodes; ++o)
                    if (sel[o] == target) {
                        q = o + 1;
                        break;
                    }
            }
        }
        par[j] = j == 0 ? -1 : q;
    }
    __syncthreads();
    const long long L = (long long)p.prefix_lens[r];
    for (int j = threadIdx.x; j < kN; j += blockDim.x) {
        int* row = p.mask + (nb + j) * kN;
        for (int c = 0; c < kN; ++c) row[c] = 0;
        int depth = 0;
        // Parents precede their children in score-index order, so the walk ends (at most N).
        for (int a = j, guard = 0; a >= 0 && guard <= kN; a = par[a], ++guard) {
            row[a] = 1;
            if (a > 0) ++depth;
        }
        p.tokens[nb + j] = j == 0 ? p.bonus_tokens[r] : p.draft_tokens[(long long)r * kNodes + j - 1];
        p.positions[nb + j] = L + depth;
        p.retrieve_index[nb + j] = nb + j;
        p.next_token[nb + j] = -1;
        p.next_sibling[nb + j] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // As SGLang's thread 0: each node, from the last, goes in front of its parent's list.
        for (int j = kN - 1; j >= 1; --j) {
            const int q = par[j];
            const long long first = p.next_token[nb + q];
            if (first >= 0) p.next_sibling[nb + j] = first;
            p.next_token[nb + q] = j;
        }
    }
}

extern "C" __global__ void __launch_bounds__(GATHER_ROWS_THREADS) gather_rows(GatherRowsParams p) {
    const unsigned z = blockIdx.x;
    if (z >= p.rows) return;
    constexpr long long H = (long long)HIDDEN;
    int s = p.src[z];
    if (s < 0 || (unsigned)s >= p.src_rows) s = 0;
    block_copy_act(p.out + (long long)z * H, p.x + (long long)s * H, H);
}
