// embed.cu: token embedding lookup concatenated with the target model's hidden state
// (the EAGLE draft input), one row per token; optionally also initializes the fc output
// rows with the fc bias (the fc GEMM then accumulates onto them with beta = 1).
//
//   out[r, 0:HIDDEN]        = table[ids[r], :]   (an id outside [0, VOCAB) reads row 0)
//   out[r, HIDDEN:2*HIDDEN] = hidden[r, :]
//   bias_out[r, :]          = bias[:]            (only when HAS_BIAS and both pointers are set)
//
// Entry:     embed_concat
//   A vocabulary-parallel embedding (a tensor-parallel rank's 1/T of the table): the table
//   holds rows EMBED_START .. EMBED_START + EMBED_ROWS of the vocabulary; an id outside them
//   gets a zero row, and with ZERO_HIDDEN (ranks other than 0) the hidden half is zeros, so
//   the all-reduce of `out` over the ranks gives every rank embed(ids) ‖ hidden.
//   Unsharded: EMBED_START 0, EMBED_ROWS VOCAB, ZERO_HIDDEN false.
// Constants: act_t, stream_t, HIDDEN, VOCAB, HAS_BIAS, EPS (unused here), EMBED_ROWS, EMBED_START,
//            ZERO_HIDDEN
// Launch:    grid (rows, parts, 1), block (EMBED_CONCAT_THREADS = 256, 1, 1), no dynamic shared memory;
//            parts = kernels::facts::row_parts (at most 8, 1 from 256 rows): CTA (r, y) copies every parts-th
//            slice of row r's segments.
// Params (by value, natural C alignment, fields in this order):
//   ids       const long long*  [rows]            token ids (int64)
//   table     const act_t*      [EMBED_ROWS, HIDDEN]   embedding table (the rank's rows)
//   hidden    const act_t*      [rows, HIDDEN]    target hidden states
//   bias      const act_t*      [HIDDEN]          fc bias, or null when !HAS_BIAS
//   out       act_t*            [rows, 2*HIDDEN]
//   bias_out  stream_t*         [rows, HIDDEN]    fc output rows to initialize (the residual
//                                                 stream: float in an unsharded draft-extend
//                                                 phase, else act_t), or null
//   rows      unsigned          number of rows; CTAs with blockIdx.x >= rows do nothing
// Pure copies: bit exact, 16-byte vectors where the row pointers are 16-byte aligned
// (always the case when HIDDEN % 8 == 0 and the buffers are), any HIDDEN handled.
//
// Entry:     embed_norm_concat (EAGLE-3's layer-0 input)
//   out[r, 0:HIDDEN]        = rmsnorm(table[ids[r], :], w_embed)   (an id outside [0, VOCAB) reads row 0)
//   out[r, HIDDEN:2*HIDDEN] = rmsnorm(h[r, :], w_hidden)
//   each RMSNorm as norm.cu's (fp32, eps EPS, one rounding to act_t).
// Constants: act_t, HIDDEN, VOCAB, HAS_BIAS (unused here), EPS
// Launch:    grid (rows, 2, 1), block (EMBED_NORM_CONCAT_THREADS = 256, 1, 1), no dynamic shared memory:
//            CTA (r, 0) writes the embedding half, CTA (r, 1) the hidden half.
// Params (by value, natural C alignment, fields in this order):
//   ids       const long long*  [rows]
//   table     const act_t*      [VOCAB, HIDDEN]   the target's embedding
//   w_embed   const act_t*      [HIDDEN]          input_layernorm
//   h         const stream_t*   [rows, HIDDEN]    fc(target features): the layer's residual (the stream)
//   w_hidden  const act_t*      [HIDDEN]          hidden_norm
//   out       act_t*            [rows, 2*HIDDEN]
//   rows      unsigned          CTAs with blockIdx.x >= rows do nothing
#include "common.cuh"

// EmbedConcatParams and EmbedNormConcatParams are declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(EMBED_CONCAT_THREADS) embed_concat(EmbedConcatParams p) {
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;
    constexpr long long H = (long long)HIDDEN;

    static_assert(EMBED_ROWS >= 1u && (unsigned long long)EMBED_START + EMBED_ROWS <= VOCAB,
                  "the table's rows are a range of the vocabulary");
    long long id = p.ids[r];
    if (id < 0 || id >= (long long)VOCAB) id = 0;  // bad ids must not fault
    const long long local = id - (long long)EMBED_START;

    const unsigned y = blockIdx.y, parts = gridDim.y;
    const long long t = (long long)y * blockDim.x + threadIdx.x, stride = (long long)blockDim.x * parts;
    act_t* dst = p.out + (long long)r * (2 * H);
    const bool in_table = local >= 0 && local < (long long)EMBED_ROWS;
    const bool bias = HAS_BIAS && p.bias != nullptr && p.bias_out != nullptr;
    stream_t* bias_row = bias ? p.bias_out + (long long)r * H : nullptr;
    if (H % 8 == 0 && aligned16(dst) && aligned16(p.table) && aligned16(p.hidden) &&
        (!bias || (aligned16(p.bias) && aligned16(bias_row)))) {
        // The three segments' loads first, then their stores: one memory latency for the
        // row, where a copy after a copy waits for the one before (perf-notes item 41).
        // An activation's zero is all-zero bits in bf16 and fp16.
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (long long v = t; v < H / 8; v += stride) {
            const uint4 h = ZERO_HIDDEN ? zero : reinterpret_cast<const uint4*>(p.hidden + (long long)r * H)[v];
            const uint4 braw = bias ? reinterpret_cast<const uint4*>(p.bias)[v] : zero;
            const uint4 e = in_table ? reinterpret_cast<const uint4*>(p.table + local * H)[v] : zero;
            reinterpret_cast<uint4*>(dst)[v] = e;
            reinterpret_cast<uint4*>(dst + H)[v] = h;
            if (bias) {
                if constexpr (SameType<stream_t, act_t>::value) {
                    reinterpret_cast<uint4*>(bias_row)[v] = braw;  // bit exact, as parts_cast
                } else {
                    float b[8];
                    load_vec<8>(reinterpret_cast<const act_t*>(&braw), b);
                    store_vec<8>(bias_row + v * 8, b);
                }
            }
        }
        return;
    }
    if (in_table) {
        parts_copy_act(dst, p.table + local * H, H, y, parts);
    } else {
        for (long long i = t; i < H; i += stride) dst[i] = to_act(0.0f);
    }
    if constexpr (ZERO_HIDDEN) {
        for (long long i = t; i < H; i += stride) dst[H + i] = to_act(0.0f);
    } else {
        parts_copy_act(dst + H, p.hidden + (long long)r * H, H, y, parts);
    }
    if (bias) parts_cast(bias_row, p.bias, H, y, parts);
}

extern "C" __global__ void __launch_bounds__(EMBED_NORM_CONCAT_THREADS) embed_norm_concat(EmbedNormConcatParams p) {
    __shared__ float scratch[32];
    const unsigned r = blockIdx.x;
    if (r >= p.rows) return;  // uniform per CTA: every thread reaches its half's reduction
    constexpr long long H = (long long)HIDDEN;

    act_t* dst = p.out + (long long)r * (2 * H);
    if (blockIdx.y == 0) {  // uniform per CTA: every thread reaches the reduction
        long long id = p.ids[r];
        if (id < 0 || id >= (long long)VOCAB) id = 0;  // bad ids must not fault
        rmsnorm_row(p.table + id * H, p.w_embed, dst, H, EPS, scratch);
    } else {
        rmsnorm_row(p.h + (long long)r * H, p.w_hidden, dst + H, H, EPS, scratch);
    }
}
