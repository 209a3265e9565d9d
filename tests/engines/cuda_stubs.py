"""Stand-ins for CUDA-only extension modules the released engines import on a machine
without a GPU, and nothing else. Import this before the first `import sglang` / `import vllm`.

SGLang 0.5.23 (CPU tensors):
  vllm._custom_ops   vLLM's CUDA kernel bindings. SGLang's RotaryEmbedding imports its
                     `rotary_embedding` at construction on a platform that is neither CUDA
                     nor ROCm (sglang/srt/layers/rotary_embedding/base.py:122-141) and calls it
                     only from forward_cuda (:453-523), so without it no Llama-family draft
                     model can be built on CPU. Only the package `vllm` and this submodule
                     exist (no other vllm module), and calling anything in it raises.
  Every other CUDA-only package SGLang names (sgl_kernel, flashinfer, deep_gemm,
  flash_attn) is imported behind guards in 0.5.23 and is not stubbed: a stub would make
  those guards succeed and change SGLang's code paths.

vLLM 0.33.0 is not stubbed here: with VLLM_TARGET_DEVICE=cpu its compiled libraries that
need libcuda fail to load and vLLM falls back by itself (vllm_env.py says what it sets).

`CALLS` records every call into a stub; the tests assert it stays empty (no stubbed kernel
ever ran).
"""

import importlib.abc
import importlib.machinery
import sys
import types

CALLS = []

_PARTIAL = {"vllm": ("_custom_ops",)}


class CudaOnly(RuntimeError):
    pass


class _Fn:
    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        CALLS.append(self.name)
        raise CudaOnly(f"{self.name} is a CUDA-only kernel stub; it must never run in these tests")


class _Module(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__file__ = f"<cuda_stubs:{name}>"

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        top = self.__name__
        if top in _PARTIAL:
            if item in _PARTIAL[top]:
                return importlib.import_module(f"{top}.{item}")
            raise AttributeError(f"module {top!r} is a stand-in with no {item!r}")
        fn = _Fn(f"{top}.{item}")
        setattr(self, item, fn)
        return fn


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] in _PARTIAL and (len(parts) == 1 or (len(parts) == 2 and parts[1] in _PARTIAL[parts[0]])):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


def install_sglang_stubs():
    """The stand-ins SGLang 0.5.23 needs on CPU (only when vLLM itself is not installed)."""
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return []
    except (ImportError, ValueError):
        pass
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return ["vllm._custom_ops"]
