# Skinny GEMM probe (perf-notes item 33): designs of gemm.cu's weight stream for m <= 16 beside
# torch.matmul (cuBLAS) and the tree's `skinny_gemm`, on the draft heads' shapes. The tree's
# gemm.cu (or the file given as BASE=path) is compiled with a hand-written prelude (act_t
# bf16, the parameter struct as the derive declares it), the variants below after it; NVRTC
# and the driver API through ctypes, tensors from torch. Run on the GPU machine:
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 python3 tests/gpu/skinny_probe.py [--quick]
# Correctness first (every variant against the fp32 product and the tree's kernel, f32 C with
# accumulate too), then the median of RUNS event-timed launches, each after an L2 flush that
# reads 256 MiB (no dirty lines written back during the timed kernel) and a read of A (hot in
# L2, as in a step).
import ctypes, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvrtc_probe import compile_cubin  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.environ.get("BASE", os.path.join(ROOT, "kernels/cuda/gemm.cu"))
COMMON = os.path.join(ROOT, "kernels/cuda/common.cuh")
QUICK = "--quick" in sys.argv
RUNS, WARM = (15, 3) if QUICK else (50, 5)

PRELUDE = r'''
#include <cuda_bf16.h>
#include <cuda_fp16.h>
using act_t = __nv_bfloat16;
constexpr unsigned SKINNY_GEMM_THREADS = 256u, GEMM_ROUND_THREADS = 256u;
// common.cuh's K/V layout words (unused by the GEMM; any distinct values compile it).
constexpr unsigned KV_WORD_MODE = 0u, KV_WORD_TABLE_ROWS = 1u, KV_WORD_TABLE_COLS = 2u, KV_WORD_TABLE_STRIDE = 3u,
  KV_WORD_SLOTS = 4u, KV_WORD_KV_STRIDE = 5u, KV_WORD_PHYS_PAGE = 6u, KV_WORD_PAGE_STRIDE = 7u,
  KV_WORD_HEAD_STRIDE = 8u, KV_MODE_TOKENS = 0u;
struct SkinnyGemmParams {
  const act_t* a; const act_t* w; float* c; act_t* c2;
  unsigned m; unsigned n; unsigned k; unsigned lda; unsigned accumulate; unsigned c_f32;
};
struct GemmRoundParams { const float* src; act_t* dst; unsigned count; };
'''

# The variants: `pipe<MT, NT, WARPS, S, PF>` streams W through a per-lane cp.async ring of S
# steps (each lane copies the 16-byte pieces it later feeds to the mma, so it reads back only
# its own slots: no barrier, no bank conflict), NT groups of 16 columns per CTA sharing A's
# fragment, WARPS warps splitting K as the tree's kernel does; PF: the CTA's W rows are
# first prefetched into L2 whole (cp.async.bulk.prefetch.L2), so DRAM sees every request of
# the CTA at once. `skinny_pf` is the tree's kernel with that prefetch.
VARIANTS = r'''
namespace pv {
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16_cg(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16_ca(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void prefetch_rows(const SkinnyGemmParams& p, long long n0, int rows) {
  const int i = (int)threadIdx.x;
  if (i < rows && n0 + i < (long long)p.n) {
    const act_t* r = p.w + (n0 + i) * (long long)p.k;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(r), "r"(p.k * 2u) : "memory");
  }
}

template <int MT, int NT, int WARPS, int S, bool PF>
__device__ __forceinline__ void pipe(const SkinnyGemmParams& p) {
  extern __shared__ __align__(16) uint4 sm[];
  constexpr int SLOT = 2 * NT + MT;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long n0 = (long long)blockIdx.x * 16 * NT;
  const long long k = p.k;
  if (PF) prefetch_rows(p, n0, 16 * NT);
  const act_t* wp[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long r = n0 + 16 * nt + g + 8 * h;
      wp[nt][h] = p.w + (r < (long long)p.n ? r : 0) * k + t * 8;
    }
  bool live[MT];
  const act_t* ap[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const unsigned row = (unsigned)(mt * 8 + g);
    live[mt] = row < p.m;
    ap[mt] = p.a + (long long)(live[mt] ? row : 0u) * p.lda + t * 8;
  }
  uint4* my = sm + (long long)warp * S * SLOT * 32 + lane;
  const int steps = (int)(k / 32);
  const int nw = warp < steps ? (steps - warp + WARPS - 1) / WARPS : 0;
  float d[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) d[mt][nt][0] = d[mt][nt][1] = d[mt][nt][2] = d[mt][nt][3] = 0.0f;
#pragma unroll
  for (int j = 0; j < S; ++j) {
    if (j < nw) {
      const long long e = (long long)(warp + j * WARPS) * 32;
      uint4* s = my + j * SLOT * 32;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) { cp16_cg(s + (2 * nt) * 32, wp[nt][0] + e); cp16_cg(s + (2 * nt + 1) * 32, wp[nt][1] + e); }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) cp16_ca(s + (2 * NT + mt) * 32, ap[mt] + e);
    }
    commit();
  }
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int j = 0; j < nw; ++j) {
    wait_group<S - 1>();
    uint4* s = my + (j % S) * SLOT * 32;
    uint4 w[NT][2], x[MT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) { w[nt][0] = s[(2 * nt) * 32]; w[nt][1] = s[(2 * nt + 1) * 32]; }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) x[mt] = live[mt] ? s[(2 * NT + mt) * 32] : zero;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) skinny::step(d[mt][nt], w[nt][0], w[nt][1], x[mt]);
    const int jn = j + S;
    if (jn < nw) {
      const long long e = (long long)(warp + jn * WARPS) * 32;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) { cp16_cg(s + (2 * nt) * 32, wp[nt][0] + e); cp16_cg(s + (2 * nt + 1) * 32, wp[nt][1] + e); }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) cp16_ca(s + (2 * NT + mt) * 32, ap[mt] + e);
    }
    commit();
  }
  wait_group<0>();
  constexpr int Q = MT * NT * 4;
  float* red = reinterpret_cast<float*>(sm + (long long)WARPS * S * SLOT * 32);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[(warp * Q + (mt * NT + nt) * 4 + j) * 32 + lane] = d[mt][nt][j];
  __syncthreads();
  for (int i = (int)threadIdx.x; i < Q * 32; i += WARPS * 32) {
    const int q = i / 32, l = i % 32;
    float sum = 0.0f;
#pragma unroll
    for (int ww = 0; ww < WARPS; ++ww) sum += red[(ww * Q + q) * 32 + l];
    const int mt = q / (NT * 4), nt = (q / 4) % NT, jj = q % 4;
    const unsigned row = (unsigned)(mt * 8 + (l & 3) * 2 + (jj & 1));
    const long long col = n0 + 16 * nt + (l >> 2) + (jj >= 2 ? 8 : 0);
    if (row >= p.m || col >= (long long)p.n) continue;
    const long long at = (long long)row * p.n + col;
    if (p.c_f32) { float* c = p.c; c[at] = p.accumulate ? c[at] + sum : sum; }
    else { act_t* c = reinterpret_cast<act_t*>(p.c); c[at] = to_act(p.accumulate ? to_f(c[at]) + sum : sum); }
  }
}
}  // namespace pv

#define PIPE(NAME, NT, WARPS, S, PF)                                                             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(SkinnyGemmParams p) {          \
    if (p.m == 0u || p.m > 16u || p.n == 0u || p.k % 32u != 0u) return;                        \
    if (p.m <= 8u) pv::pipe<1, NT, WARPS, S, PF>(p); else pv::pipe<2, NT, WARPS, S, PF>(p);     \
  }
PIPE(p_n1_w8_s4, 1, 8, 4, false)
PIPE(p_n1_w8_s8, 1, 8, 8, false)
PIPE(p_n1_w4_s8, 1, 4, 8, false)
PIPE(p_n1_w4_s16, 1, 4, 16, false)
PIPE(p_n2_w8_s4, 2, 8, 4, false)
PIPE(p_n2_w4_s8, 2, 4, 8, false)
PIPE(p_n1_w8_s8_pf, 1, 8, 8, true)
PIPE(p_n1_w16_s4, 1, 16, 4, false)

extern "C" __global__ void __launch_bounds__(SKINNY_GEMM_THREADS) skinny_pf(SkinnyGemmParams p) {
  if (p.m == 0u || p.m > 16u || p.n == 0u || p.k % 32u != 0u) return;
  pv::prefetch_rows(p, (long long)blockIdx.x * 16, 16);
  if (p.m <= 8u) skinny::body<1>(p); else skinny::body<2>(p);
}
'''

# name -> (columns per CTA, warps, stages, slot 16-byte pieces per lane besides A) ; None = tree
KERNELS = {
    "skinny_gemm": None, "skinny_pf": None,
    "p_n1_w8_s4": (1, 8, 4), "p_n1_w8_s8": (1, 8, 8), "p_n1_w4_s8": (1, 4, 8), "p_n1_w4_s16": (1, 4, 16),
    "p_n2_w8_s4": (2, 8, 4), "p_n2_w4_s8": (2, 4, 8), "p_n1_w8_s8_pf": (1, 8, 8), "p_n1_w16_s4": (1, 16, 4),
}


def ck(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: {rc}")


def source():
    common = open(COMMON).read()
    base = open(BASE).read().replace('#include "common.cuh"', common, 1)
    return PRELUDE + base + VARIANTS


cubin, log = compile_cubin(source(), "skinny_probe.cu", ["-lineinfo"])
if "--compile-only" in sys.argv:
    print(log)
    print(f"compiled: {len(cubin)} bytes of CUBIN")
    sys.exit(0)
import torch
cuda = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda")  # the primary context, current
mod = ctypes.c_void_p(); ck(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
funcs = {}
for name in KERNELS:
    f = ctypes.c_void_p(); ck(cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), f"get {name}")
    # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8; NUM_REGS = 4; LOCAL_SIZE_BYTES = 3
    ck(cuda.cuFuncSetAttribute(f, 8, 200 * 1024), f"smem {name}")
    regs, local = ctypes.c_int(), ctypes.c_int()
    cuda.cuFuncGetAttribute(ctypes.byref(regs), 4, f); cuda.cuFuncGetAttribute(ctypes.byref(local), 3, f)
    funcs[name] = f
    print(f"{name}: {regs.value} registers, {local.value} B local")


class Params(ctypes.Structure):
    _fields_ = [("a", ctypes.c_uint64), ("w", ctypes.c_uint64), ("c", ctypes.c_uint64), ("c2", ctypes.c_uint64)] + [
        (f, ctypes.c_uint32) for f in ("m", "n", "k", "lda", "accumulate", "c_f32")]


def smem_and_grid(name, m, nn):
    cfg = KERNELS[name]
    if cfg is None:
        return 0, (nn + 15) // 16, 256
    nt, warps, s = cfg
    mt = 1 if m <= 8 else 2
    return warps * s * (2 * nt + mt) * 32 * 16 + warps * mt * nt * 4 * 32 * 4, (nn + 16 * nt - 1) // (16 * nt), warps * 32


def launch(name, a, w, c, m, nn, k, lda, acc, cf32, stream):
    smem, grid, block = smem_and_grid(name, m, nn)
    # The kernels take the parameter struct by value: one kernel parameter, its bytes.
    args = Params(a.data_ptr(), w.data_ptr(), c.data_ptr(), 0, m, nn, k, lda, acc, cf32)  # c2: none
    ptrs = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    ck(cuda.cuLaunchKernel(funcs[name], grid, 1, 1, block, 1, 1, smem, ctypes.c_void_p(stream.cuda_stream), ptrs, None),
       f"launch {name}")


flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").view(torch.float32).uniform_()
stream = torch.cuda.current_stream()
ev = lambda: torch.cuda.Event(enable_timing=True)


def timed(body, a):
    out = []
    for i in range(RUNS + WARM):
        flush.max()  # reads 256 MiB: W leaves L2, nothing dirty is left to write back
        a.sum()  # A hot in L2, as the previous launch of a step leaves it
        e0, e1 = ev(), ev()
        e0.record(stream); body(); e1.record(stream)
        torch.cuda.synchronize()
        if i >= WARM:
            out.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(out)


# Correctness on awkward shapes first: ragged n, lda > k, m 1/5/9/16, f32 C with accumulate.
torch.manual_seed(0)
bad = 0
for m, nn, k, lda in [(1, 37, 64, 64), (5, 100, 96, 128), (9, 1000, 512, 520), (16, 4096, 4096, 4096), (8, 129, 8192, 8192)]:
    x = torch.randn(m, lda, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16)
    ref = x[:, :k].float() @ w.float().T
    for name in KERNELS:
        c = torch.full((m, nn), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch(name, x, w, c, m, nn, k, lda, 0, 0, stream)
        init = torch.randn(m, nn, device="cuda")
        cf = init.clone()
        launch(name, x, w, cf, m, nn, k, lda, 1, 1, stream)
        torch.cuda.synchronize()
        e1 = ((c.float() - ref).norm() / ref.norm()).item()
        e2 = ((cf - init - ref).norm() / ref.norm()).item()
        ok = e1 < 5e-3 and e2 < 1e-5 and not torch.isnan(c).any().item()
        bad += not ok
        if not ok:
            print(f"WRONG {name} m {m} n {nn} k {k} lda {lda}: bf16 rel {e1:.2e}, f32+acc rel {e2:.2e}")
print(f"correctness: {'all variants ok' if bad == 0 else f'{bad} failures'}")

SHAPES = [("fc E1", 4096, 8192), ("fc E3", 4096, 12288), ("qkv llama2", 12288, 4096), ("qkv llama3", 6144, 4096),
          ("qkv E3", 6144, 8192), ("o_proj", 4096, 4096), ("gate_up llama2", 22016, 4096),
          ("gate_up llama3", 28672, 4096), ("down llama2", 4096, 11008), ("down llama3", 4096, 14336),
          ("lm_head 32k", 32000, 4096), ("lm_head 128k", 128256, 4096)]
MS = [1, 8, 16] if QUICK else [1, 4, 8, 16]
COPY_TBS = 4.24
names = list(KERNELS)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; medians of {RUNS}, µs (floor: W + A + C bytes at {COPY_TBS} TB/s)")
print("| shape | m | n | k | floor | cuBLAS | " + " | ".join(names) + " | best/floor |")
print("|---|---|---|---|---|---|" + "---|" * len(names) + "---|")
for label, nn, k in SHAPES:
    w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, nn, device="cuda", dtype=torch.bfloat16)
        floor = (nn * k + m * k + m * nn) * 2 / (COPY_TBS * 1e12) * 1e6
        row = [timed(lambda: torch.matmul(x, w.T, out=c), x)]
        for name in names:
            row.append(timed(lambda name=name: launch(name, x, w, c, m, nn, k, k, 0, 0, stream), x))
        best = min(row)
        print(f"| {label} | {m} | {nn} | {k} | {floor:.1f} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {best / floor:.2f} |")
