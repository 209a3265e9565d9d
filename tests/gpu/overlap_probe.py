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
# them), the read alone, both at once on two streams, and both at once against their sum and
# their max. The read's sum is checked exactly (the buffer holds ones). Medians of 20 runs after
# 3, an L2 flush (256 MiB written) before each. NVRTC and the driver API through ctypes for the
# read kernel, torch for the rest. Run on the GPU machine (about 20 s):
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
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def timed(body, runs=20, warm=3):
        """Median µs from an event on s1 to the next after `body(start)`, L2 flushed first."""
        out = []
        for i in range(runs + warm):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s1)
            body(a)
            b.record(s1)
            torch.cuda.synchronize()
            if i >= warm:
                out.append(a.elapsed_time(b) * 1000)
        return statistics.median(out)

    # The matmul ceiling, as specbench measures it in spirit: one large bf16 GEMM.
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda a: torch.matmul(big, big))
    peak = 2 * 8192**3 / (t * 1e-6)
    big = None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16 matmul {peak / 1e12:.0f} TFLOP/s "
          f"(8192^3); read kernel {THREADS} threads a CTA, 8 x 16 B in flight a thread")
    print("| shape | K/V MiB | G | GEMMs µs (at peak) | GEMMs at M/2 twice µs | read µs (TB/s) | both at once µs "
          "| at once / sum | at once / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for label, m, gemms, kvs in SHAPES:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in gemms]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in gemms]
        cs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n, _ in gemms]
        flops = sum(2 * m * n * k for n, k in gemms)

        def gemms_on(stream, half=False):
            with torch.cuda.stream(stream):
                for x, w, c in zip(xs, ws, cs):
                    if half:
                        h = m // 2
                        torch.matmul(x[:h], w.T, out=c[:h])
                        torch.matmul(x[h:], w.T, out=c[h:])
                    else:
                        torch.matmul(x, w.T, out=c)

        ref = (xs[0][:64].float() @ ws[0].float().T)
        gemms_on(s1)
        torch.cuda.synchronize()
        assert ((cs[0][:64].float() - ref).norm() / ref.norm()).item() < 1e-2, "cuBLAS's product"
        t_g = timed(lambda a: gemms_on(s1))
        t_h = timed(lambda a: gemms_on(s1, half=True))
        for kv_bytes in kvs:
            buf = torch.ones(kv_bytes // 4, device="cuda", dtype=torch.int32)
            out = torch.zeros(1, device="cuda", dtype=torch.int64)
            for grid in GRIDS:
                out.zero_()
                read(buf, out, grid, s1)
                torch.cuda.synchronize()
                if out.item() != buf.numel():
                    sys.exit(f"read_sum: {out.item()} != {buf.numel()} (grid {grid})")
                t_r = timed(lambda a: read(buf, out, grid, s1))

                def both(a):
                    s2.wait_event(a)
                    read(buf, out, grid, s2)
                    done = torch.cuda.Event()
                    done.record(s2)
                    gemms_on(s1)
                    s1.wait_event(done)

                t_b = timed(both)
                print(f"| {label} | {kv_bytes / 2**20:.0f} | {grid} | {t_g:.1f} ({flops / peak * 1e6:.1f}) | {t_h:.1f} "
                      f"| {t_r:.1f} ({kv_bytes / (t_r * 1e-6) / 1e12:.2f}) | {t_b:.1f} | {t_b / (t_g + t_r):.3f} "
                      f"| {t_b / max(t_g, t_r):.3f} |")
            buf = None
        xs = ws = cs = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
