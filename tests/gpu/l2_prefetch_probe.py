# L2 prefetch probe (perf-notes, sixteenth session): does a weight prefetched into L2 while the
# GPU does DRAM-idle work make the next skinny GEMM faster? torch.matmul (cuBLAS) for the GEMM,
# NVRTC + the driver API through ctypes for the prefetch kernels. Run on the GPU machine:
# LD_LIBRARY_PATH=/usr/local/cuda/lib64 python3 tests/gpu/l2_prefetch_probe.py
import ctypes, statistics, sys, torch

SRC = r'''
extern "C" __global__ void pf_bulk(const char* p, unsigned long long bytes, unsigned chunk) {
  unsigned long long step = (unsigned long long)gridDim.x * blockDim.x * chunk;
  for (unsigned long long i = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < bytes; i += step) {
    unsigned long long left = bytes - i; unsigned n = left < chunk ? (unsigned)left : chunk;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + i), "r"(n) : "memory");
  }
}
extern "C" __global__ void pf_line(const char* p, unsigned long long bytes) {
  unsigned long long step = (unsigned long long)gridDim.x * blockDim.x * 128;
  for (unsigned long long i = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * 128; i < bytes; i += step)
    asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + i) : "memory");
}
'''

def ck(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: {rc}")

nvrtc = ctypes.CDLL("/usr/local/cuda/lib64/libnvrtc.so")
cuda = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda")  # the primary context, current
prog = ctypes.c_void_p()
ck(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SRC.encode(), b"pf.cu", 0, None, None), "nvrtcCreateProgram")
opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=sm_90")
rc = nvrtc.nvrtcCompileProgram(prog, 1, opts)
if rc != 0:
    n = ctypes.c_size_t(); nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value); nvrtc.nvrtcGetProgramLog(prog, log)
    sys.exit(log.value.decode())
n = ctypes.c_size_t(); ck(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "size")
cubin = ctypes.create_string_buffer(n.value); ck(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
mod = ctypes.c_void_p(); ck(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
fb, fl = ctypes.c_void_p(), ctypes.c_void_p()
ck(cuda.cuModuleGetFunction(ctypes.byref(fb), mod, b"pf_bulk"), "get pf_bulk")
ck(cuda.cuModuleGetFunction(ctypes.byref(fl), mod, b"pf_line"), "get pf_line")

def launch(f, grid, block, args, stream):
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in args])
    ck(cuda.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream), ptrs, None), "cuLaunchKernel")

def prefetch(kind, w, stream, ctas=8, chunk=65536):
    bytes_ = w.numel() * w.element_size()
    if kind == "bulk":
        launch(fb, ctas, 32, [ctypes.c_uint64(w.data_ptr()), ctypes.c_uint64(bytes_), ctypes.c_uint32(chunk)], stream)
    else:
        launch(fl, ctas, 256, [ctypes.c_uint64(w.data_ptr()), ctypes.c_uint64(bytes_)], stream)

flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
s1 = torch.cuda.current_stream(); s2 = torch.cuda.Stream()
ev = lambda: torch.cuda.Event(enable_timing=True)

def timed(body, runs=40, warm=5, setup=lambda: None):
    """Median µs of `body` between two events on s1, after an L2 flush and `setup` (untimed)."""
    out = []
    for i in range(runs + warm):
        flush.zero_()
        setup()
        a, b = ev(), ev()
        a.record(s1); body(a); b.record(s1)
        torch.cuda.synchronize()
        if i >= warm:
            out.append(a.elapsed_time(b) * 1000)
    return statistics.median(out)

shapes = [("o_proj m1", 1, 4096, 4096), ("o_proj m8", 8, 4096, 4096), ("fc m4", 4, 4096, 8192),
          ("down m1 (llama2)", 1, 4096, 11008), ("qkv m4 (llama2)", 4, 12288, 4096)]
IDLE_US = 30.0
sleep_cycles = int(IDLE_US * 1980)  # _sleep counts SM clocks (1980 MHz max on the H200)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")
print("| shape | MiB | GEMM flushed µs | GEMM after prefetch (bulk) µs | (line) µs | idle 30 µs + GEMM µs | same, bulk prefetch on a 2nd stream µs | (line) | saved µs |")
print("|---|---|---|---|---|---|---|---|---|")
for name, m, nn, k in shapes:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ w.float().T)
    y = x @ w.T
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
    mib = w.numel() * 2 / 2**20
    g = lambda a: torch.matmul(x, w.T)
    plain = timed(g)
    def after(kind):
        def land():
            prefetch(kind, w, s1)
            torch.cuda._sleep(int(60 * 1980))  # let the prefetches land
        return timed(g, setup=land)
    pb, pl = after("bulk"), after("line")
    def idle_gemm(a):
        torch.cuda._sleep(sleep_cycles); torch.matmul(x, w.T)
    base = timed(idle_gemm)
    def overlapped(kind):
        def body(a):
            s2.wait_event(a)
            prefetch(kind, w, s2)
            e = torch.cuda.Event(); e.record(s2)
            torch.cuda._sleep(sleep_cycles)  # s1's DRAM-idle work (attention, small kernels)
            s1.wait_event(e)
            torch.matmul(x, w.T)
        return body
    ob, ol = timed(overlapped("bulk")), timed(overlapped("line"))
    print(f"| {name} | {mib:.0f} | {plain:.1f} | {pb:.1f} | {pl:.1f} | {base:.1f} | {ob:.1f} | {ol:.1f} | {base - min(ob, ol):.1f} |")
# The prefetch kernel alone (how long its CTA is busy issuing).
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for kind in ("bulk", "line"):
    t = timed(lambda a, kind=kind: prefetch(kind, w, s1))
    print(f"prefetch kernel alone ({kind}, 32 MiB, 8 CTAs): {t:.1f} µs")
