# Programmatic dependent launch probe (perf-notes item 34): does a chain of weight-streaming
# GEMMs and small kernels, captured in one CUDA graph as a draft-extend step at B 1 is, run
# closer to its floor when each launch may start before its predecessor ends (PDL), and when
# the GEMM streams the first stages of its weight (which no predecessor writes) before it
# waits? Kernels: a small kernel (a few CTAs: wait, optionally trigger the dependents, spin
# SPIN cycles, write the next GEMM's A from the last GEMM's C) and gemm.cu's weight stream
# as a per-lane cp.async ring (tests/gpu/skinny_probe.py's `pipe`), both calling
# griddepcontrol.wait before they read what a predecessor wrote. NVRTC and the driver API
# through ctypes, torch for tensors and the graph. Run on the GPU machine:
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 python3 tests/gpu/pdl_probe.py
# Each variant's final output is compared bit for bit with the plain chain's (a wait that
# did not hold would show as a race), then the replay is timed: median of 7 rounds of 40
# back-to-back replays (the chain's weights, 0.5 GB, are more than L2 holds).
import ctypes, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvrtc_probe import compile_cubin  # noqa: E402

SRC = r'''
#include <cuda_bf16.h>
using act_t = __nv_bfloat16;
struct P { const act_t* a; const act_t* w; act_t* c; unsigned m, n, k; };

__device__ __forceinline__ void dep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void dep_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
__device__ __forceinline__ void wait_upto(int j) {  // wait_group j for 0 <= j < 8
  switch (j) { case 0: wait_group<0>(); break; case 1: wait_group<1>(); break; case 2: wait_group<2>(); break;
    case 3: wait_group<3>(); break; case 4: wait_group<4>(); break; case 5: wait_group<5>(); break;
    case 6: wait_group<6>(); break; default: wait_group<7>(); break; }
}
__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void step(float (&d)[4], uint4 wa, uint4 wb, uint4 x) {
  mma(d, wa.x, wb.x, wa.y, wb.y, x.x, x.y);
  mma(d, wa.z, wb.z, wa.w, wb.w, x.z, x.w);
}

// C[m, n] = A[m, k] W[n, k]^T, 16 columns a CTA, WARPS warps splitting K, a ring of S steps
// per warp. PRE: the first S steps' W pieces are copied before griddepcontrol.wait (a group
// each), A's after it (one group). TRIG: the dependents may launch at once.
template <int MT, int WARPS, int S, bool PRE, bool TRIG>
__device__ __forceinline__ void gemm(const P& p) {
  extern __shared__ __align__(16) uint4 sm[];
  constexpr int SLOT = 2 + MT;
  if (TRIG) dep_launch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const long long n0 = (long long)blockIdx.x * 16, k = p.k;
  const long long r0 = n0 + g < p.n ? n0 + g : 0, r1 = n0 + g + 8 < p.n ? n0 + g + 8 : 0;
  const act_t* w0 = p.w + r0 * k + t * 8;
  const act_t* w1 = p.w + r1 * k + t * 8;
  bool live[MT]; const act_t* ap[MT];
  for (int mt = 0; mt < MT; ++mt) { unsigned row = mt * 8 + g; live[mt] = row < p.m; ap[mt] = p.a + (long long)(live[mt] ? row : 0u) * k + t * 8; }
  uint4* my = sm + (long long)warp * S * SLOT * 32 + lane;
  const int steps = (int)(k / 32);
  const int nw = warp < steps ? (steps - warp + WARPS - 1) / WARPS : 0;
  auto wcopy = [&](int j) { const long long e = (long long)(warp + j * WARPS) * 32; uint4* s = my + (j % S) * SLOT * 32;
                            cp16(s, w0 + e); cp16(s + 32, w1 + e); };
  auto acopy = [&](int j) { const long long e = (long long)(warp + j * WARPS) * 32; uint4* s = my + (j % S) * SLOT * 32;
                            for (int mt = 0; mt < MT; ++mt) cp16(s + (2 + mt) * 32, ap[mt] + e); };
  if (PRE) {
    for (int j = 0; j < S; ++j) { if (j < nw) wcopy(j); commit(); }
    dep_wait();
    for (int j = 0; j < S; ++j) if (j < nw) acopy(j);
    commit();
  } else {
    dep_wait();
    for (int j = 0; j < S; ++j) { if (j < nw) { wcopy(j); acopy(j); } commit(); }
  }
  float d[MT][4];
  for (int mt = 0; mt < MT; ++mt) d[mt][0] = d[mt][1] = d[mt][2] = d[mt][3] = 0.0f;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int j = 0; j < nw; ++j) {
    if (PRE && j < S) wait_upto(j); else wait_group<S - 1>();
    uint4* s = my + (j % S) * SLOT * 32;
    const uint4 wa = s[0], wb = s[32];
    for (int mt = 0; mt < MT; ++mt) step(d[mt], wa, wb, live[mt] ? s[(2 + mt) * 32] : zero);
    if (j + S < nw) { wcopy(j + S); acopy(j + S); }
    commit();
  }
  wait_group<0>();
  constexpr int Q = MT * 4;
  float* red = reinterpret_cast<float*>(sm + (long long)WARPS * S * SLOT * 32);
  for (int mt = 0; mt < MT; ++mt) for (int j = 0; j < 4; ++j) red[(warp * Q + mt * 4 + j) * 32 + lane] = d[mt][j];
  __syncthreads();
  for (int i = threadIdx.x; i < Q * 32; i += WARPS * 32) {
    const int q = i / 32, l = i % 32;
    float sum = 0.0f;
    for (int ww = 0; ww < WARPS; ++ww) sum += red[(ww * Q + q) * 32 + l];
    const int mt = q / 4, jj = q % 4;
    const unsigned row = mt * 8 + (l & 3) * 2 + (jj & 1);
    const long long col = n0 + (l >> 2) + (jj >= 2 ? 8 : 0);
    if (row < p.m && col < p.n) p.c[(long long)row * p.n + col] = __float2bfloat16_rn(sum);
  }
}

#define GEMM(NAME, PRE, TRIG) extern "C" __global__ void __launch_bounds__(256) NAME(P p) { \
  if (p.m <= 8u) gemm<1, 8, 8, PRE, TRIG>(p); else gemm<2, 8, 8, PRE, TRIG>(p); }
GEMM(g_plain, false, false)
GEMM(g_pre, true, false)
GEMM(g_pre_trig, true, true)

// The small kernel between GEMMs: out[i] = prev[i mod prev_n] / 2 after `spin` cycles.
// trig: 0 never, 1 at the start (before its own wait), 2 after the spin.
extern "C" __global__ void small(const act_t* prev, act_t* out, unsigned long long prev_n, unsigned long long n,
                                 unsigned long long spin, unsigned trig) {
  if (trig == 1u) dep_launch();
  dep_wait();
  const long long t0 = clock64();
  while (clock64() - t0 < (long long)spin) {}
  if (trig == 2u) dep_launch();
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(__bfloat162float(prev[i % prev_n]) * 0.5f);
}
'''


def ck(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: {rc}")


cubin, log = compile_cubin(SRC, "pdl_probe.cu")
if "--compile-only" in sys.argv:
    print(log)
    print(f"compiled: {len(cubin)} bytes of CUBIN")
    sys.exit(0)

import torch  # noqa: E402

cuda = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda")
mod = ctypes.c_void_p(); ck(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
F = {}
for name in ("g_plain", "g_pre", "g_pre_trig", "small"):
    f = ctypes.c_void_p(); ck(cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
    ck(cuda.cuFuncSetAttribute(f, 8, 160 * 1024), f"smem {name}")
    F[name] = f


class Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("nattrs", ctypes.c_uint)]


class GemmP(ctypes.Structure):
    _fields_ = [("a", ctypes.c_uint64), ("w", ctypes.c_uint64), ("c", ctypes.c_uint64),
                ("m", ctypes.c_uint32), ("n", ctypes.c_uint32), ("k", ctypes.c_uint32)]


KEEP = []  # arguments stay alive until the graph is instantiated


def launch(f, grid, block, smem, args, stream, pdl):
    attr = Attr(6, b"", 1 if pdl else 0)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    cfg = Config(grid, 1, 1, block, 1, 1, smem, ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attr), 1 if pdl else 0)
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in args])
    KEEP.extend([attr, cfg, ptrs, args])
    ck(cuda.cuLaunchKernelEx(ctypes.byref(cfg), f, ptrs, None), "cuLaunchKernelEx")


SPIN = int(os.environ.get("SPIN", 3 * 1980))  # ~3 µs at the H200's 1980 MHz
CHAIN = [("fc", 4096, 8192), ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
VARIANTS = {  # gemm kernel (or cuBLAS), PDL attribute, small kernel's trigger
    "plain": ("g_plain", False, 0), "cublas": ("cublas", False, 0),
    "pdl": ("g_plain", True, 1), "pdl+pre": ("g_pre", True, 1),
    "pdl+pre late trigger": ("g_pre", True, 2), "pdl+pre+gemm trigger": ("g_pre_trig", True, 1),
}


def build(m, variant, ws, xs, cs, seed_in):
    kern, pdl, trig = VARIANTS[variant]
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    prev, prev_n = seed_in, seed_in.numel()
    with torch.cuda.graph(g, stream=s):
        for (name, nn, k), w, x, c in zip(CHAIN, ws, xs, cs):
            launch(F["small"], 8, 256, 0, [ctypes.c_uint64(prev.data_ptr()), ctypes.c_uint64(x.data_ptr()),
                   ctypes.c_uint64(prev_n), ctypes.c_uint64(m * k), ctypes.c_uint64(SPIN), ctypes.c_uint32(trig)], s, pdl)
            if kern == "cublas":
                torch.matmul(x, w.T, out=c)
            else:
                mt = 1 if m <= 8 else 2
                smem = 8 * 8 * (2 + mt) * 32 * 16 + 8 * mt * 4 * 32 * 4
                args = GemmP(x.data_ptr(), w.data_ptr(), c.data_ptr(), m, nn, k)
                launch(F[kern], (nn + 15) // 16, 256, smem, [args], s, pdl)
            prev, prev_n = c, m * nn
    return g


def timed(g):
    rounds = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(40):
            g.replay()
        e1.record(); torch.cuda.synchronize()
        rounds.append(e0.elapsed_time(e1) * 1000 / 40)
    return statistics.median(rounds)


torch.manual_seed(0)
ws = [torch.randn(nn, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _, nn, k in CHAIN]
torch.matmul(ws[0][:1], ws[0].T)  # cuBLAS's handle, made before any capture (it cannot be made in one)
floor_w = sum(nn * k * 2 for _, nn, k in CHAIN) / 4.24e12 * 1e6
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; chain: 5 x (small kernel, {SPIN} cycles on 8 CTAs; GEMM): "
      + ", ".join(f"{nm} {nn}x{k}" for nm, nn, k in CHAIN) + f"; weights at 4.24 TB/s: {floor_w:.1f} µs")
print("| m | variant | replay µs | vs plain | output == plain |")
print("|---|---|---|---|---|")
for m in (1, 8, 16):
    xs = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _, nn, k in CHAIN]
    cs = [torch.empty(m, nn, device="cuda", dtype=torch.bfloat16) for _, nn, k in CHAIN]
    seed_in = torch.randn(m * 4096, device="cuda", dtype=torch.bfloat16)
    ref, base = None, None
    for variant in VARIANTS:
        g = build(m, variant, ws, xs, cs, seed_in)
        for c in cs:
            c.fill_(float("nan"))
        g.replay(); torch.cuda.synchronize()
        out = cs[-1].clone()
        if ref is None:
            ref = out
        same = "n/a (cuBLAS)" if variant == "cublas" else ("yes" if torch.equal(out, ref) else "NO")
        ok_ref = torch.isfinite(out).all().item()
        t = timed(g)
        base = base or t
        print(f"| {m} | {variant} | {t:.1f} | {t / base:.3f} | {same}{'' if ok_ref else ' (non-finite!)'} |")
        del g
        KEEP.clear()
