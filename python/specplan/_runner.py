"""DraftExtendRunner: a plan replayed on the caller's PyTorch tensors (KV pools, page table,
weights registered once and used in place; inputs and the stream per step).

Every tensor is checked on the host before anything is launched (dtype, shape, device,
contiguity or strides; the error names the argument and what was expected); each request
is checked again on the device (table row, lengths, token slots, ids), where a bad request
is refused without writing anything and reported by `last_error()`.
"""

import os

from . import _native


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised where torch is absent
        raise ImportError("specplan.DraftExtendRunner needs PyTorch (pip install torch)") from e
    return torch


class DeviceError:
    """What the device-side checks refused in the last step: `count` requests (none of
    which wrote anything), the first refused `request` (its index in the batch) and the
    `rule` it broke."""

    __slots__ = ("count", "request", "rule")

    def __init__(self, count, request, rule):
        self.count, self.request, self.rule = count, request, rule

    def __repr__(self):
        return f"DeviceError(count={self.count}, request={self.request}, rule={self.rule!r})"

    def __str__(self):
        return f"{self.count} request(s) refused on the device (each wrote nothing); request {self.request}: {self.rule}"


class DraftExtendOutput:
    """One step's outputs: views of the runner's own buffers, valid until its next `run`
    (clone them to keep them longer, as with SGLang's graph runners)."""

    __slots__ = ("topk_p", "topk_index", "hidden_states")

    def __init__(self, topk_p, topk_index, hidden_states):
        self.topk_p, self.topk_index, self.hidden_states = topk_p, topk_index, hidden_states

    def __repr__(self):
        return f"DraftExtendOutput(topk_p={tuple(self.topk_p.shape)}, topk_index={tuple(self.topk_index.shape)}, hidden_states={tuple(self.hidden_states.shape)})"


_DTYPE_NAMES = None


def _dtype_name(torch, dt):
    global _DTYPE_NAMES
    if _DTYPE_NAMES is None:
        _DTYPE_NAMES = {
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.float32: "f32",
            torch.int64: "i64",
            torch.int32: "i32",
        }
    return _DTYPE_NAMES.get(dt)


def _need_tensor(torch, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


class DraftExtendRunner:
    """Runs a plan's draft-extend forward on an engine's memory.

    plan          specplan.Plan (with kernels)
    weights       dict[str, torch.Tensor] on the GPU under the plan's weight names (Hugging
                  Face / EAGLE names; a leading "model." is accepted), used in place; or a
                  path to a .safetensors file (loaded onto the GPU once)
    k_cache, v_cache
                  one tensor per layer, [slots, kv_heads, head_dim] (SGLang's token pools)
                  or [pages, page_size, kv_heads, head_dim] (vLLM's blocks, e.g. kv[0] and
                  kv[1] of its [2, blocks, block, kv_heads, head_dim] layer tensor)
    req_to_token  torch.int32 [rows, max_context] token slots (SGLang), or
    block_table   torch.int32 [rows, max_pages] page ids; exactly one of the two
    gemms         "cached" (default: cuBLASLt algorithms from the on-disk cache, timed once
                  per shape), "heuristic" or "retune"

    The registered tensors must stay alive and in place for the runner's life (it keeps
    references to them).
    """

    def __init__(self, plan, weights, k_cache, v_cache, req_to_token=None, block_table=None, *, gemms="cached"):
        from . import Plan

        torch = _torch()
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a specplan.Plan, got {type(plan).__name__}")
        if not plan.has_kernels:
            raise ValueError("plan: it carries no kernel binaries (compiled with no_kernels=True); compile it with NVRTC")
        if not torch.cuda.is_available():
            raise RuntimeError("DraftExtendRunner needs a CUDA GPU: torch.cuda.is_available() is False")
        self.plan = plan
        self._torch = torch
        self._act = {"bf16": torch.bfloat16, "fp16": torch.float16}[plan.dtype]
        self._n = plan.num_draft_tokens
        self._h = plan.hidden_size
        self._hin = plan.hidden_in_size
        self._k = plan.topk
        self._max_b = plan.max_requests
        self._max_ctx = plan.max_context_len
        kp, ks, kslots, kstride, kpage, device = self._pools("k_cache", k_cache)
        vp, vs, vslots, vstride, vpage, vdevice = self._pools("v_cache", v_cache)
        if (ks, vslots, vstride) != (vs, kslots, kstride) or vdevice != device:
            raise ValueError(
                f"v_cache: shape {vs} / slot stride {vstride} on {vdevice} differs from k_cache's {ks} / {kstride} on {device}"
            )
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        table, mode, page = self._table(req_to_token, block_table, kpage)
        self._weights = self._load_weights(weights)
        listed = []
        for name, t in self._weights.items():
            listed.append((name, t.data_ptr(), _dtype_name(torch, t.dtype), list(t.shape)))
            if name.startswith("model."):
                listed.append((name[len("model."):], t.data_ptr(), _dtype_name(torch, t.dtype), list(t.shape)))
        self._pools_kept = (list(k_cache), list(v_cache), table)
        with torch.cuda.device(self._index):
            self._engine = _native.Engine(
                plan._p, kp, vp, kslots, kstride, table.data_ptr(), mode, table.shape[0], table.shape[1],
                table.stride(0), page, listed, self._index, gemms,
            )
        r = self._max_b
        self._out_p = torch.empty((r, self._k), dtype=torch.float32, device=device)
        self._out_i = torch.empty((r, self._k), dtype=torch.int64, device=device)
        self._out_h = torch.empty((r, self._h), dtype=self._act, device=device)
        self._views = {}
        self._i32, self._i64 = torch.int32, torch.int64
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        idx = self._index
        self._stream = (lambda: raw(idx)) if raw is not None else (lambda: torch.cuda.current_stream(idx).cuda_stream)

    # ---- registration checks (once) ----

    def _pools(self, name, pools):
        torch = self._torch
        plan = self.plan
        if not isinstance(pools, (list, tuple)) or len(pools) != plan.num_layers:
            got = f"{len(pools)} items" if isinstance(pools, (list, tuple)) else type(pools).__name__
            raise ValueError(f"{name}: expected a list of {plan.num_layers} tensors (one per layer), got {got}")
        first = None
        ptrs = []
        for layer, t in enumerate(pools):
            what = f"{name}[{layer}]"
            _need_tensor(torch, what, t)
            if t.dtype != self._act:
                raise TypeError(f"{what}: dtype {t.dtype}, the plan's K/V are {self._act}")
            if t.device.type != "cuda":
                raise ValueError(f"{what}: on {t.device}, expected a CUDA device")
            kvh, d = plan.num_kv_heads, plan.head_dim
            if t.dim() == 3 and tuple(t.shape[1:]) == (kvh, d):
                slots, stride, page = t.shape[0], t.stride(0), None
            elif t.dim() == 4 and tuple(t.shape[2:]) == (kvh, d):
                slots, stride, page = t.shape[0] * t.shape[1], t.stride(1), t.shape[1]
                if t.stride(0) != t.shape[1] * t.stride(1):
                    raise ValueError(f"{what}: pages are not {t.shape[1]} slots of stride {t.stride(1)} apart (strides {t.stride()})")
            else:
                raise ValueError(
                    f"{what}: shape {tuple(t.shape)}, expected [slots, {kvh}, {d}] or [pages, page_size, {kvh}, {d}]"
                )
            if t.stride(-1) != 1 or t.stride(-2) != d:
                raise ValueError(f"{what}: each slot's [{kvh}, {d}] must be contiguous (strides {t.stride()})")
            sig = (tuple(t.shape), t.stride(), t.device)
            if first is None:
                first = sig
            elif sig != first:
                raise ValueError(f"{what}: shape/strides/device {sig} differ from layer 0's {first}")
            ptrs.append(t.data_ptr())
        return ptrs, first[0], slots, stride, page, first[2]

    def _table(self, req_to_token, block_table, kv_page):
        torch = self._torch
        if (req_to_token is None) == (block_table is None):
            raise ValueError("give exactly one of req_to_token= (token slots, SGLang) or block_table= (page ids)")
        name, t = ("req_to_token", req_to_token) if req_to_token is not None else ("block_table", block_table)
        _need_tensor(torch, name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: dtype {t.dtype}, expected torch.int32")
        if t.dim() != 2:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected 2-D [rows, columns]")
        if t.device != self._device:
            raise ValueError(f"{name}: on {t.device}, the K/V pools are on {self._device}")
        if t.stride(1) != 1:
            raise ValueError(f"{name}: columns must be contiguous (strides {t.stride()})")
        if req_to_token is not None:
            return t, "token_slots", 1
        page = kv_page if kv_page is not None else self.plan.page_size
        return t, "page_ids", page

    def _load_weights(self, weights):
        torch = self._torch
        if isinstance(weights, (str, os.PathLike)):
            try:
                from safetensors.torch import load_file
            except ImportError as e:
                raise ImportError("weights given as a path need the safetensors package") from e
            weights = load_file(os.fspath(weights), device=str(self._device))
        if not isinstance(weights, dict):
            raise TypeError(f"weights: expected a dict of tensors or a .safetensors path, got {type(weights).__name__}")
        out = {}
        for name, t in weights.items():
            what = f"weights[{name!r}]"
            _need_tensor(torch, what, t)
            if t.device != self._device:
                raise ValueError(f"{what}: on {t.device}, the K/V pools are on {self._device}")
            if not t.is_contiguous():
                raise ValueError(f"{what}: not contiguous (strides {t.stride()})")
            if _dtype_name(torch, t.dtype) is None:
                raise TypeError(f"{what}: dtype {t.dtype} is none of bfloat16, float16, float32, int64, int32")
            out[name] = t
        return out

    # ---- per step ----

    def _ints(self, name, t, b):
        if not isinstance(t, self._torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        dt = t.dtype
        if dt is not self._i64 and dt is not self._i32:
            raise TypeError(f"{name}: dtype {dt}, expected torch.int64 or torch.int32")
        if t.shape != (b,):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [{b}]")
        if t.get_device() != self._index:
            raise ValueError(f"{name}: on {t.device}, expected {self._device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: not contiguous")
        return dt is self._i32

    def run(self, input_ids, hidden_states, req_pool_indices, prefix_lens, accept_lens, prefix_lens_cpu=None, *,
            prefix_includes_new_tokens=False):
        """One draft-extend step of b = len(req_pool_indices) requests, on the current stream;
        returns once it is enqueued (no host synchronization).

        input_ids         int64 [b*N] or [b, N]
        hidden_states     [b*N, H] or [b, N, H], the plan's dtype (the target's hidden states)
        req_pool_indices  int64/int32 [b]: rows of the registered table
        prefix_lens       int64/int32 [b]: tokens already cached per request (or SGLang's
                          seq_lens = prefix + N, with prefix_includes_new_tokens=True)
        accept_lens       int64/int32 [b]: accepted tokens per request, in [1, N]
        prefix_lens_cpu   optional host copy of prefix_lens: checked here first, so a bad
                          length raises ValueError instead of being refused on the device
        """
        torch = self._torch
        b = req_pool_indices.shape[0] if isinstance(req_pool_indices, torch.Tensor) else None
        req_i32 = self._ints("req_pool_indices", req_pool_indices, b)
        if not 0 < b <= self._max_b:
            raise ValueError(f"req_pool_indices: batch {b} is outside [1, {self._max_b}] (the plan's max_requests)")
        prefix_i32 = self._ints("prefix_lens", prefix_lens, b)
        accept_i32 = self._ints("accept_lens", accept_lens, b)
        n = self._n
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype is not self._i64:
            raise TypeError(f"input_ids: dtype {input_ids.dtype}, expected torch.int64")
        if input_ids.numel() != b * n or input_ids.dim() > 2:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected [{b * n}] or [{b}, {n}]")
        if input_ids.get_device() != self._index or not input_ids.is_contiguous():
            raise ValueError(f"input_ids: must be contiguous on {self._device} (is on {input_ids.device})")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dtype is not self._act:
            raise TypeError(f"hidden_states: dtype {hidden_states.dtype}, the plan's activations are {self._act}")
        hin = self._hin
        if hidden_states.numel() != b * n * hin or hidden_states.shape[-1] != hin or hidden_states.dim() > 3:
            raise ValueError(
                f"hidden_states: shape {tuple(hidden_states.shape)}, expected [{b * n}, {hin}] or [{b}, {n}, {hin}]"
            )
        if hidden_states.get_device() != self._index or not hidden_states.is_contiguous():
            raise ValueError(f"hidden_states: must be contiguous on {self._device} (is on {hidden_states.device})")
        bias = -n if prefix_includes_new_tokens else 0
        if prefix_lens_cpu is not None:
            self._check_lengths(prefix_lens_cpu, b, bias)
        self._engine.step(
            b, input_ids.data_ptr(), hidden_states.data_ptr(), req_pool_indices.data_ptr(), req_i32,
            prefix_lens.data_ptr(), prefix_i32, bias, accept_lens.data_ptr(), accept_i32,
            self._out_p.data_ptr(), self._out_i.data_ptr(), self._out_h.data_ptr(), self._stream(),
        )
        out = self._views.get(b)
        if out is None:
            out = DraftExtendOutput(self._out_p[:b], self._out_i[:b], self._out_h[:b])
            self._views[b] = out
        return out

    def _check_lengths(self, lens, b, bias):
        values = lens.tolist() if hasattr(lens, "tolist") else list(lens)
        if len(values) != b:
            raise ValueError(f"prefix_lens_cpu: {len(values)} values, expected {b}")
        for i, v in enumerate(values):
            prefix = int(v) + bias
            if prefix < 0 or prefix + self._n > self._max_ctx:
                raise ValueError(
                    f"prefix_lens_cpu[{i}]: prefix {prefix} puts positions {prefix}..{prefix + self._n - 1} outside [0, {self._max_ctx}) (the plan's max_context_len)"
                )

    def can_run(self, batch_size):
        """Whether a captured graph serves this batch size."""
        return self._engine.can_run(int(batch_size))

    def last_error(self):
        """None, or the DeviceError of the last step (waits for that step to finish)."""
        e = self._engine.last_error()
        return None if e is None else DeviceError(*e)

    def load_times(self):
        """Load time split (ms): setup, GEMM choice, graph capture, total."""
        return self._engine.load_times()
