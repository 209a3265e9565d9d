// select.cu: picks, per request, the hidden row of its last accepted token.
//
//   A = clamp(accept_lens[i], 1, N)
//   out[i, :] = x[i*N + A - 1, :]
//
// Entry:     select_rows
// Constants: act_t, HIDDEN, N
// Launch:    grid (batch, 1, 1), block (SELECT_ROWS_THREADS = 256, 1, 1), no dynamic shared memory.
// Params (by value, natural C alignment, fields in this order):
//   x            const act_t*  [batch*N, HIDDEN]
//   accept_lens  const int*    [batch]  accepted tokens per request (clamped to [1, N])
//   out          act_t*        [batch, HIDDEN]
//   batch        unsigned      CTAs with blockIdx.x >= batch do nothing
// Pure copy: bit exact, 16-byte vectors when the rows are 16-byte aligned.
#include "common.cuh"

// SelectRowsParams is declared by the generated prelude, from specplan_kernels
// (#[derive(KernelParams)]): the Rust and C sides share one definition.

extern "C" __global__ void __launch_bounds__(SELECT_ROWS_THREADS) select_rows(SelectRowsParams p) {
    const unsigned i = blockIdx.x;
    if (i >= p.batch) return;
    constexpr long long H = (long long)HIDDEN;
    constexpr int kN = (int)N;

    int a = p.accept_lens[i];
    a = a < 1 ? 1 : (a > kN ? kN : a);
    const long long src_row = (long long)i * kN + (a - 1);
    block_copy_act(p.out + (long long)i * H, p.x + src_row * H, H);
}
