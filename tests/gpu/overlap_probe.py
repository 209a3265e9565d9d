# Overlap probe (perf-notes item 37): at the large buckets the attention rows' GEMMs are
# compute-bound (M = B·N = 512-1024) and the attention is bandwidth-bound, and a step that runs
# them one after another cannot beat the sum of the two (specbench's per-op floor). Would the
# two overlap if they ran at once — the step's batch split in two halves, one half's attention
# beside the other half's GEMMs on a second stream? This probe answers the hardware half of that
# question before any plan changes: the three compute-bound GEMMs of a shape (fc, qkv, o_proj at
# the bucket's M, torch.matmul = cuBLAS) beside a bandwidth-bound read of the attention's K/V
# bytes (a kernel of G CTAs, so the read can leave the GEMMs most of the SMs), alone and at once.
#
# Printed per shape and G: the GEMMs alone (and at M/2 twice: what splitting the batch costs
# them); the read alone on G CTAs and on every SM; both at once on two streams, the read launched
# first (and when each stream was done) and the GEMMs launched first; and the split-batch
# pipeline itself (half 1's GEMMs, then half 1's read on G CTAs beside half 2's GEMMs, then half
# 2's read alone). Each is compared with the best sequential schedule (the GEMMs, then the read
# on every SM). The read's sum is checked exactly (the buffer holds ones). Medians of 20 runs
# after 3; before each, an L2 flush that reads 256 MiB (a written flush would leave dirty lines
# whose write-back the next kernel pays) and a host lead. NVRTC and the driver API through
# ctypes for the read kernel, torch for the rest. Run on the GPU machine (about 40 s):
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 python3 tests/gpu/overlap_probe.py
# Here: `--compile-only` (NVRTC of the read kernel).
import ctypes, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvrtc_probe import compile_cubin  # noqa: E402

THREADS = 512
SRC = r'''
// Sums the 32-bit words of p[0, n) (16-byte pieces) into *out: 8 pieces a thread in flight (the
// launch bounds' minimum of 2 CTAs an SM lets ptxas hoist all 8 loads; without it, 4), a
// grid-stride loop, streaming loads (read once), a warp's sum added atomically.
extern "C" __global__ void __launch_bounds__(512, 2) read_sum(const uint4* p, unsigned long long n,
                                                           unsigned long long* out) {
  unsigned long long acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += (unsigned long long)v[u].x + v[u].y + v[u].z + v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc += (unsigned long long)v.x + v.y + v.z + v.w;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31u) == 0u) atomicAdd(out, acc);
}
'''

# (label, M = B·N, the three GEMMs' (n, k), the attention's K/V bytes at L 1024 and 4096):
# B 64, bf16, K/V read = B · (L + N) · kv_heads · 128 · 2 (K and V) · 2 bytes.
def kv(b, n, l, kv_heads):
    return b * (l + n) * kv_heads * 128 * 2 * 2


SHAPES = [
    ("llama3-8b-eagle N 16 B 64", 1024, [(4096, 8192), (6144, 4096), (4096, 4096)],
     [kv(64, 16, 1024, 8), kv(64, 16, 4096, 8)]),
    ("llama3.1-8b-eagle3 N 8 B 64", 512, [(4096, 12288), (6144, 8192), (4096, 4096)],
     [kv(64, 8, 1024, 8), kv(64, 8, 4096, 8)]),
    ("llama2-7b-eagle N 16 B 64", 1024, [(4096, 8192), (12288, 4096), (4096, 4096)],
     [kv(64, 16, 1024, 32)]),
]
GRIDS = [16, 33, 66, 132]
FULL_GRID = 264  # two CTAs an SM on 132 SMs: the read alone


def ck(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: {rc}")


def main():
    cubin, log = compile_cubin(SRC, "overlap_probe.cu")
    if "--compile-only" in sys.argv:
        print(log)
        print(f"compiled: {len(cubin)} bytes of CUBIN")
        return
    import torch

    sys.stdout.reconfigure(line_buffering=True)
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")
    mod, f = ctypes.c_void_p(), ctypes.c_void_p()
    ck(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    ck(cuda.cuModuleGetFunction(ctypes.byref(f), mod, b"read_sum"), "read_sum")

    def read(buf, out, grid, stream):
        args = [ctypes.c_uint64(buf.data_ptr()), ctypes.c_uint64(buf.numel() // 4), ctypes.c_uint64(out.data_ptr())]
        ptrs = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        ck(cuda.cuLaunchKernel(f, grid, 1, 1, THREADS, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream), ptrs, None),
           "cuLaunchKernel")

    s1, s2 = torch.cuda.current_stream(), torch.cuda.Stream()
    # The L2 flush reads 256 MiB (so L2 is left holding clean lines: a written flush would make
    # the next kernel pay for its write-back, once per timing, which biases a sum of two
    # timings against one), then the host gets ahead of the device before the start event.
    flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    flush_sum = torch.zeros(1, device="cuda", dtype=torch.int64)

    def timed(body, runs=20, warm=3):
        """Median µs from an event on s1 to the next after `body(start)`, and the median of
        each timed event `body` returns, from the start."""
        total, marks = [], []
        for i in range(runs + warm):
            read(flush, flush_sum, 264, s1)
            torch.cuda._sleep(40_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s1)
            evs = body(a)
            evs = evs if isinstance(evs, list) else []  # a body may return a tensor or nothing
            b.record(s1)
            torch.cuda.synchronize()
            if i >= warm:
                total.append(a.elapsed_time(b) * 1000)
                marks.append([a.elapsed_time(e) * 1000 for e in evs])
        return statistics.median(total), [statistics.median(x) for x in zip(*marks)]

    def mark(stream):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    # The matmul ceiling, as specbench measures it in spirit: one large bf16 GEMM.
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t, _ = timed(lambda a: torch.matmul(big, big))
    peak = 2 * 8192**3 / (t * 1e-6)
    big = None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16 matmul {peak / 1e12:.0f} TFLOP/s "
          f"(8192^3); read kernel {THREADS} threads a CTA, 8 x 16 B in flight a thread")
    print("Columns: the GEMMs alone (their FLOPs at that peak); at M/2 twice; the read alone on G CTAs "
          f"(TB/s) and on {FULL_GRID}; both at once (read launched first; when each stream was done); the same "
          "with the GEMMs launched first; the split-batch pipeline (GEMMs of half 1, then half 1's read on G "
          f"CTAs beside half 2's GEMMs, then half 2's read on {FULL_GRID}). Each ratio is against the best "
          f"sequential schedule: the GEMMs, then the read on {FULL_GRID} CTAs.")
    print("| shape | K/V MiB | G | GEMMs µs (at peak) | at M/2 twice | read µs on G (TB/s); on all | at once µs "
          "(GEMMs, read done) | / sequential | GEMMs first µs | / sequential | pipeline µs | / sequential (M/2) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for label, m, gemms, kvs in SHAPES:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in gemms]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in gemms]
        cs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n, _ in gemms]
        flops = sum(2 * m * n * k for n, k in gemms)
        h = m // 2

        def gemms_on(stream, rows=None):
            """The three GEMMs over all M rows, or over rows `rows` (a slice) only."""
            with torch.cuda.stream(stream):
                for x, w, c in zip(xs, ws, cs):
                    if rows is None:
                        torch.matmul(x, w.T, out=c)
                    else:
                        torch.matmul(x[rows], w.T, out=c[rows])

        ref = (xs[0][:64].float() @ ws[0].float().T)
        gemms_on(s1)
        torch.cuda.synchronize()
        assert ((cs[0][:64].float() - ref).norm() / ref.norm()).item() < 1e-2, "cuBLAS's product"
        t_g, _ = timed(lambda a: gemms_on(s1))
        t_h, _ = timed(lambda a: (gemms_on(s1, slice(0, h)), gemms_on(s1, slice(h, m)))[-1])
        for kv_bytes in kvs:
            buf = torch.ones(kv_bytes // 4, device="cuda", dtype=torch.int32)
            halves = (buf[: buf.numel() // 2], buf[buf.numel() // 2:])
            out = torch.zeros(1, device="cuda", dtype=torch.int64)
            t_rf, _ = timed(lambda a: read(buf, out, FULL_GRID, s1))  # the read alone at its best
            for grid in GRIDS:
                out.zero_()
                read(buf, out, grid, s1)
                torch.cuda.synchronize()
                if out.item() != buf.numel():
                    sys.exit(f"read_sum: {out.item()} != {buf.numel()} (grid {grid})")
                t_r, _ = timed(lambda a: read(buf, out, grid, s1))

                def both(a, gemms_first=False):
                    s2.wait_event(a)
                    if gemms_first:
                        gemms_on(s1)
                        g_done = mark(s1)
                        read(buf, out, grid, s2)
                    else:
                        read(buf, out, grid, s2)
                        gemms_on(s1)
                        g_done = mark(s1)
                    r_done = mark(s2)
                    s1.wait_event(r_done)
                    return [g_done, r_done]

                def pipeline(a):
                    gemms_on(s1, slice(0, h))
                    first = mark(s1)
                    s2.wait_event(first)
                    read(halves[0], out, grid, s2)
                    gemms_on(s1, slice(h, m))
                    read(halves[1], out, FULL_GRID, s1)  # alone: every SM
                    s1.wait_event(mark(s2))

                t_b, (g_at, r_at) = timed(both)
                t_f, _ = timed(lambda a: both(a, gemms_first=True))
                t_p, _ = timed(pipeline)
                print(f"| {label} | {kv_bytes / 2**20:.0f} | {grid} | {t_g:.1f} ({flops / peak * 1e6:.1f}) | {t_h:.1f} "
                      f"| {t_r:.1f} ({kv_bytes / (t_r * 1e-6) / 1e12:.2f}); {t_rf:.1f} | {t_b:.1f} ({g_at:.1f}, {r_at:.1f}) "
                      f"| {t_b / (t_g + t_rf):.3f} | {t_f:.1f} | {t_f / (t_g + t_rf):.3f} | {t_p:.1f} "
                      f"| {t_p / (t_h + t_rf):.3f} |")
            buf = halves = None
        xs = ws = cs = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
