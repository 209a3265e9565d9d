# NVRTC through ctypes for the GPU probes (skinny_probe.py, pdl_probe.py): one source to a
# CUBIN for sm_90. NVRTC and the CUDA headers are the GPU machine's toolkit by default; on a
# machine without one, NVRTC_LIB and CUDA_INC name the pinned wheel's (.ci/with-nvrtc), so
# `--compile-only` checks a probe's kernels here.
import ctypes
import os
import sys


def compile_cubin(src, name, extra=()):
    """Returns (CUBIN bytes, compile log) of `src`; exits with the log when NVRTC refuses it."""
    nvrtc = ctypes.CDLL(os.environ.get("NVRTC_LIB", "/usr/local/cuda/lib64/libnvrtc.so"))
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if rc != 0:
        sys.exit(f"nvrtcCreateProgram failed: {rc}")
    inc = os.environ.get("CUDA_INC", "/usr/local/cuda/include")
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"-I" + inc.encode(), b"--ptxas-options=-v",
            *[o.encode() for o in extra]]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(log.value.decode())
    if nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)) != 0:
        sys.exit("nvrtcGetCUBINSize failed")
    cubin = ctypes.create_string_buffer(n.value)
    if nvrtc.nvrtcGetCUBIN(prog, cubin) != 0:
        sys.exit("nvrtcGetCUBIN failed")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log.value.decode()
