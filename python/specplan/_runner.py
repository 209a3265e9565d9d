"""DraftExtendRunner: a plan replayed on the caller's PyTorch tensors (KV pools, page table,
weights registered once and used in place; inputs and the stream per step).

Every tensor is checked on the host before anything is launched (dtype, shape, device,
contiguity or strides; the error names the argument and what was expected); each request
is checked again on the device (table row, lengths, token slots, ids), where a bad request
is refused without writing anything (its outputs are zeros) and reported by `last_error()`
or, without waiting, `poll_error()`.

CUDA tensors run the plan's CUDA graphs on the current stream; CPU tensors run the CPU
executor on them in place (the same registration, rules and outputs: for tests of an
engine adapter on a machine without a GPU).
"""

import operator
import os

from . import _native


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised where torch is absent
        raise ImportError("specplan.DraftExtendRunner needs PyTorch (pip install torch)") from e
    return torch


class DeviceError:
    """What the device-side checks refused or flagged in a step: `count` requests, the
    first such `request` (its index in the batch), the `rule` it broke, and for the
    aliasing rule the `other` request writing a cache slot it reads (itself when two of
    its positions share one). A refused request wrote nothing and its outputs are zeros;
    one flagged for non-finite outputs wrote its K/V and its outputs are as computed."""

    __slots__ = ("count", "request", "rule", "other")

    def __init__(self, count, request, rule, other=None):
        self.count, self.request, self.rule, self.other = count, request, rule, other

    def __repr__(self):
        return (f"DeviceError(count={self.count}, request={self.request}, rule={self.rule!r}, "
                f"other={self.other!r})")

    def __str__(self):
        if self.request < 0:  # the ring lost steps (poll_error): no request to name
            return self.rule
        with_ = ""
        if self.other is not None:
            with_ = (" (with itself: two of its positions share a slot)" if self.other == self.request
                     else f" (with request {self.other}, which writes a slot it reads)")
        return f"{self.count} request(s) refused or flagged on the device; request {self.request}{with_}: {self.rule}"


class DraftExtendOutput:
    """One step's outputs: views of the runner's own buffers, valid until its next `run`
    (clone them to keep them longer, as with SGLang's graph runners). `topk_p` /
    `topk_index` are None when the plan emits no top-K, `logits` when it emits no logits
    (the plan's `outputs`)."""

    __slots__ = ("topk_p", "topk_index", "hidden_states", "logits")

    def __init__(self, topk_p, topk_index, hidden_states, logits):
        self.topk_p, self.topk_index, self.hidden_states, self.logits = topk_p, topk_index, hidden_states, logits

    def __repr__(self):
        shape = lambda t: None if t is None else tuple(t.shape)  # noqa: E731
        return (
            f"DraftExtendOutput(topk_p={shape(self.topk_p)}, topk_index={shape(self.topk_index)}, "
            f"hidden_states={shape(self.hidden_states)}, logits={shape(self.logits)})"
        )


_DTYPE_NAMES = None


def _engine_tp(plan, engine, size, rank, get_group):
    """The tensor-parallel group a plan needs on an engine running its draft over `size`
    ranks (this one `rank`), or None unsharded: the plan must be this rank's, with the
    embedding split by vocabulary (the engines' VocabParallelEmbedding shard is used in place).
    `get_group` gives the engine's `get_tp_group()` (called only when sharded)."""
    size, rank = int(size or 1), int(rank or 0)
    if plan.tp_size == 1 and size == 1:
        return None
    if (plan.tp_size, plan.tp_rank) != (size, rank):
        raise ValueError(
            f"plan: rank {plan.tp_rank} of tp_size {plan.tp_size}, but {engine} runs the draft as rank {rank} of "
            f"{size}; compile this rank's plan (tp_size={size}, tp_rank={rank}, tp_embedding=\"vocab\")")
    if plan.tp_embedding != "vocab":
        raise ValueError(
            f"plan: {engine} holds the draft's embedding split by vocabulary over its {size} ranks "
            "(VocabParallelEmbedding): compile with tp_embedding=\"vocab\"")
    return get_group()


def _nccl_comm(group):
    """The ncclComm_t address of an engine's tensor-parallel group (0: none): SGLang 0.5.23
    keeps it at `get_tp_group().pynccl_comm.comm` (srt/distributed/parallel_state.py:462-464,
    device_communicators/pynccl.py:125-129), vLLM 0.33.0 at `get_tp_group()
    .device_communicator.pynccl_comm.comm` (distributed/device_communicators/
    cuda_communicator.py:106-108, pynccl.py:180); both a ctypes.c_void_p."""
    if group is None:
        return 0
    if isinstance(group, bool):
        raise TypeError("tp_group: expected a tensor-parallel group, a PyNccl communicator or an address")
    if isinstance(group, int):
        return group
    for path in (("value",), ("comm",), ("pynccl_comm", "comm"), ("device_communicator", "pynccl_comm", "comm")):
        x = group
        for attr in path:
            x = getattr(x, attr, None)
            if x is None:
                break
        if x is None:
            continue
        x = getattr(x, "value", x)
        if isinstance(x, int) and not isinstance(x, bool) and x:
            return x
    raise TypeError(f"tp_group: {type(group).__name__} has no NCCL communicator (pynccl_comm.comm or "
                    f"device_communicator.pynccl_comm.comm); pass the engine's get_tp_group() or an ncclComm_t address")


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


def _TORCH_DTYPES(torch):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16, "f32": torch.float32,
            "i64": torch.int64, "i32": torch.int32}


def _int_arg(name, x):
    """An integer argument (a Python, NumPy or 0-d tensor integer; not a bool) as an int."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}") from None


def _need_tensor(torch, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _need_memory(name, t)
    return t


def _need_memory(name, t):
    """A tensor whose memory holds its values: not on the meta device (no memory), not a
    lazily negated or conjugated view (its memory holds the un-negated values, which the
    kernels would read)."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: on the meta device, which holds no memory")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name}: a lazily negated or conjugated view; pass t.resolve_neg() or t.resolve_conj()")


# KV layouts a runner takes in place, by the order of a per-layer tensor's dimensions:
#   separate K and V tensors (k_cache=, v_cache=), last dim head_dim:
#     3-D [slots, kv_heads, head_dim]                     SGLang's token pools (NHD)
#     4-D "NHD" [pages, page_size, kv_heads, head_dim]    paged, token-major
#     4-D "HND" [pages, kv_heads, page_size, head_dim]    SGLang's HND pools
#   one tensor per layer with K and V packed in the last dim, 2 * head_dim (kv_cache=):
#     4-D "BHNC" [blocks, kv_heads, block, 2 * head_dim]  vLLM 0.33's logical view (its
#                                                         physical order is in the strides)
#     4-D "BNHC" [blocks, block, kv_heads, 2 * head_dim]
# Each gives the geometry (slots, page, page_stride, slot_stride, head_stride) in elements.
_SEPARATE = ("NHD", "HND")
_PACKED = ("BHNC", "BNHC")


class Engine:
    """The engine's memory registered once for a plan: its K/V pools, page table and draft
    weights, used in place. Each phase of the plan runs through a runner made from it
    (`engine.draft_extend()`), so every phase shares the one registration.

    plan          specplan.Plan (with kernels for CUDA tensors)
    weights       dict[str, torch.Tensor] on the pools' device under the plan's weight names
                  (Hugging Face / EAGLE names; a leading "model." is accepted, and a tensor
                  with more rows than the plan's, as a padded lm_head, is used by its first
                  rows), used in place; or a path to a .safetensors file (loaded once)
    k_cache, v_cache
                  one tensor per layer each (see the layouts above; kv_layout "NHD" or "HND"
                  for 4-D tensors)
    kv_cache      instead: one tensor per layer with K and V packed in the last dimension
                  (kv_layout "BHNC", vLLM's, or "BNHC")
    req_to_token  torch.int32 [rows, max_context] token slots (SGLang), or
    block_table   torch.int32 [rows, max_pages] page ids; exactly one of the two
    block_size    tokens per block_table entry (default: the pool's page; vLLM's manager
                  block when its kernel blocks, the pool's pages, are smaller)
    gemms         "cached" (default: cuBLASLt algorithms from the on-disk cache, timed once
                  per shape), "heuristic" or "retune"
    l2_prefetch   the graphs' L2 prefetch branches: "off" (default) or "MIB[xCTAS][/MAXB]",
                  e.g. "32" (each GEMM's first 32 MiB asked for while the small launches
                  before it run) or "32/8" (only in the buckets of at most 8 requests);
                  CUDA tensors only (the CPU engine captures no graphs)
    tp_group      a sharded plan's (`tp_size` > 1) communicator over the engine's ranks: the
                  engine's tensor-parallel group (SGLang 0.5.23's and vLLM 0.33.0's
                  `get_tp_group()`), its PyNccl communicator, or an `ncclComm_t` address;
                  its rank and size must be the plan's. The NCCL library specplan loads
                  (`libnccl.so` on the loader path) must be the engine's (a link to torch's
                  `libnccl.so.2`), so the communicator is the same object

    The registered tensors must stay alive and in place for the runner's life (it keeps
    references to them).
    """

    def __init__(self, plan, weights, k_cache=None, v_cache=None, req_to_token=None, block_table=None, *,
                 kv_cache=None, kv_layout=None, block_size=None, gemms="cached", tp_group=None,
                 l2_prefetch="off"):
        from . import Plan

        torch = _torch()
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a specplan.Plan, got {type(plan).__name__}")
        self.plan = plan
        self._torch = torch
        self._act = _TORCH_DTYPES(torch)[plan.dtype]
        kp, vp, geom, page, device, kept = self._kv(k_cache, v_cache, kv_cache, kv_layout)
        self._device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            if not plan.has_kernels:
                raise ValueError("plan: it carries no kernel binaries (compiled with no_kernels=True); compile it with NVRTC")
            if not torch.cuda.is_available():
                raise RuntimeError("specplan.Engine on CUDA tensors needs a CUDA GPU: torch.cuda.is_available() is False")
            self._index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            self._index = -1
        if not isinstance(l2_prefetch, str):
            raise TypeError(f"l2_prefetch: expected a str (\"off\" or \"MIB[xCTAS][/MAXB]\"), got {type(l2_prefetch).__name__}")
        if block_size is not None:
            block_size = _int_arg("block_size", block_size)
            if not 1 <= block_size < 2**31:
                raise ValueError(f"block_size: {block_size} is outside [1, 2^31 - 1]")
            if req_to_token is not None:
                raise ValueError("block_size: applies to block_table (vLLM's blocks); req_to_token holds token slots")
        table, mode, tpage = self._table(req_to_token, block_table, block_size or page)
        self._weights = self._load_weights(weights)
        listed = []
        for name, t in self._weights.items():
            listed.append((name, t.data_ptr(), _dtype_name(torch, t.dtype), list(t.shape)))
            if name.startswith("model."):
                listed.append((name[len("model."):], t.data_ptr(), _dtype_name(torch, t.dtype), list(t.shape)))
        self._pools_kept = (kept, table)
        args = (plan._p, kp, vp, geom, table.data_ptr(), mode, table.shape[0], table.shape[1], table.stride(0), tpage, listed)
        comm, self._tp_kept = _nccl_comm(tp_group), tp_group
        if self._cuda:
            with torch.cuda.device(self._index):
                self._engine = _native.Engine(*args, self._index, gemms, comm, l2_prefetch)
        else:
            if comm:
                raise ValueError("tp_group: the CPU engine runs unsharded plans only")
            if l2_prefetch not in ("off", "0"):
                raise ValueError(f"l2_prefetch {l2_prefetch!r}: the CPU engine captures no graphs (\"off\" only)")
            if gemms not in ("cached", "heuristic", "retune"):
                raise ValueError(f"gemms {gemms!r}: expected \"cached\", \"heuristic\" or \"retune\"")
            self._engine = _native.CpuEngine(*args)
        self._runners = {}
        if self._cuda:
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            idx = self._index
            self._stream = (lambda: raw(idx)) if raw is not None else (lambda: torch.cuda.current_stream(idx).cuda_stream)
        else:
            self._stream = lambda: 0

    def draft_extend(self, plan=None):
        """The runner of the plan's draft-extend phase on this registration (one per engine;
        `plan`, if given, must be the engine's own plan)."""
        _same_plan(self.plan, plan)
        r = self._runners.get("draft_extend")
        if r is None:
            r = DraftExtendRunner._on(self)
            self._runners["draft_extend"] = r
        return r

    def draft_decode(self, steps=None, plan=None):
        """The runner of the plan's draft-decode tier `steps` (default: the config's
        num_steps, or the plan's only tier) on this registration (one per engine and tier)."""
        from ._decode import DraftDecodeRunner, _phase_label

        _same_plan(self.plan, plan)
        label, _ = _phase_label(self.plan, steps)
        r = self._runners.get(label)
        if r is None:
            r = DraftDecodeRunner._on(self, steps)
            self._runners[label] = r
        return r

    @property
    def device(self):
        return self._device

    def last_error(self):
        """None, or the DeviceError of the last step of any phase (waits for it to finish)."""
        e = self._engine.last_error()
        return None if e is None else DeviceError(*e)

    def load_times(self):
        """Load time split (ms): setup, GEMM choice, graph capture, total."""
        return self._engine.load_times()

    # ---- registration checks (once) ----

    def _kv(self, k_cache, v_cache, kv_cache, kv_layout):
        """K and V base addresses per layer, the geometry, the pool's page (None: token
        pools), the device and the tensors to keep alive."""
        torch = self._torch
        plan = self.plan
        packed = kv_cache is not None
        if packed == (k_cache is not None or v_cache is not None):
            raise ValueError("give either k_cache= and v_cache= (separate pools) or kv_cache= (K and V packed), not both")
        if packed:
            layout = kv_layout or "BHNC"
            if layout not in _PACKED:
                raise ValueError(f"kv_layout {layout!r}: a packed kv_cache is {' or '.join(_PACKED)}")
            geom, page, dev, ptrs = self._layers("kv_cache", kv_cache, layout, packed=True)
            d = plan.head_dim * 2  # bytes of K's head_dim elements: V follows
            return ptrs, [p + d for p in ptrs], geom, page, dev, list(kv_cache)
        if k_cache is None or v_cache is None:
            raise ValueError("give both k_cache= and v_cache= (one tensor per layer each)")
        layout = kv_layout or "NHD"
        if layout not in _SEPARATE:
            raise ValueError(f"kv_layout {layout!r}: separate k_cache/v_cache are {' or '.join(_SEPARATE)}")
        kg, kpage, kdev, kp = self._layers("k_cache", k_cache, layout, packed=False)
        vg, vpage, vdev, vp = self._layers("v_cache", v_cache, layout, packed=False)
        if (kg, kpage, kdev) != (vg, vpage, vdev):
            raise ValueError(
                f"v_cache: geometry {vg} (page {vpage}) on {vdev} differs from k_cache's {kg} (page {kpage}) on {kdev}"
            )
        return kp, vp, kg, kpage, kdev, list(k_cache) + list(v_cache)

    def _layers(self, name, pools, layout, packed):
        torch = self._torch
        plan = self.plan
        if not isinstance(pools, (list, tuple)) or len(pools) != plan.num_layers:
            got = f"{len(pools)} items" if isinstance(pools, (list, tuple)) else type(pools).__name__
            raise ValueError(f"{name}: expected a list of {plan.num_layers} tensors (one per layer), got {got}")
        kvh, d = plan.num_kv_heads, plan.head_dim
        last = 2 * d if packed else d
        first = None
        ptrs = []
        for layer, t in enumerate(pools):
            what = f"{name}[{layer}]"
            _need_tensor(torch, what, t)
            if t.dtype != self._act:
                raise TypeError(f"{what}: dtype {t.dtype}, the plan's K/V are {self._act}")
            if t.device.type not in ("cuda", "cpu"):
                raise ValueError(f"{what}: on {t.device}, expected a CUDA or CPU device")
            s, shape = t.stride(), tuple(t.shape)
            if packed:
                want = {"BHNC": "[blocks, %d, block, %d]" % (kvh, last), "BNHC": "[blocks, block, %d, %d]" % (kvh, last)}
                heads_dim = 1 if layout == "BHNC" else 2
                if t.dim() != 4 or shape[heads_dim] != kvh or shape[3] != last:
                    raise ValueError(f"{what}: shape {shape}, expected {want[layout]} (kv_layout {layout})")
                slot_dim = 2 if layout == "BHNC" else 1
                page = shape[slot_dim]
                geom = (shape[0] * page, page, s[0], s[slot_dim], s[heads_dim])
            elif t.dim() == 3:
                if shape[1:] != (kvh, d):
                    raise ValueError(f"{what}: shape {shape}, expected [slots, {kvh}, {d}]")
                page = None
                geom = (shape[0], 1, s[0], s[0], s[1])
            elif t.dim() == 4:
                heads_dim, slot_dim = (2, 1) if layout == "NHD" else (1, 2)
                if shape[heads_dim] != kvh or shape[3] != d:
                    want = f"[pages, page_size, {kvh}, {d}]" if layout == "NHD" else f"[pages, {kvh}, page_size, {d}]"
                    raise ValueError(f"{what}: shape {shape}, expected {want} (kv_layout {layout})")
                page = shape[slot_dim]
                geom = (shape[0] * page, page, s[0], s[slot_dim], s[heads_dim])
            else:
                raise ValueError(
                    f"{what}: shape {shape}, expected [slots, {kvh}, {d}] or a 4-D paged tensor (kv_layout NHD/HND)"
                )
            if s[-1] != 1:
                raise ValueError(f"{what}: the last dimension must be contiguous (strides {s})")
            if any(x <= 0 or x % 8 for x in geom[2:]):
                raise ValueError(f"{what}: strides {s} must be positive multiples of 8 elements (16-byte rows)")
            sig = (geom, page, t.device)
            if first is None:
                first = sig
            elif sig != first:
                raise ValueError(f"{what}: geometry/device {sig} differ from layer 0's {first}")
            ptrs.append(t.data_ptr())
        return first[0], first[1], first[2], ptrs

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
        rows = {}
        for name, dtype, shape, sources in self.plan.weights():
            rows[name] = shape[0]
            for s in sources:
                rows.setdefault(s, None)
        out = {}
        # Rows a vocabulary-sized weight may carry past the plan's (padding); any other
        # weight's shape is the plan's exactly (the runtime checks it).
        vocab_rows = {self.plan.vocab_size, self.plan.draft_vocab_size}
        bare = {}
        for name, t in weights.items():
            if not isinstance(name, str):
                raise TypeError(f"weights: keys must be tensor names (str), got {type(name).__name__}")
            what = f"weights[{name!r}]"
            _need_tensor(torch, what, t)
            if t.device != self._device:
                raise ValueError(f"{what}: on {t.device}, the K/V pools are on {self._device}")
            key = name[len("model."):] if name.startswith("model.") else name
            if key in bare:
                raise ValueError(f"{what}: given twice, as {bare[key]!r} and {name!r}; pass one")
            bare[key] = name
            want = rows.get(key)
            if want is not None and want in vocab_rows and t.dim() == 2 and t.shape[0] > want:
                # A vocabulary padded past the plan's rows (SGLang pads lm_head to a
                # multiple of 64): its first rows, a contiguous view.
                t = t[:want]
            if not t.is_contiguous():
                raise ValueError(f"{what}: not contiguous (strides {t.stride()})")
            if _dtype_name(torch, t.dtype) is None:
                raise TypeError(f"{what}: dtype {t.dtype} is none of bfloat16, float16, float32, int64, int32")
            out[name] = t
        return out

def _same_plan(mine, given):
    from . import Plan

    if given is None or given is mine:
        return
    if not isinstance(given, Plan):
        raise TypeError(f"plan: expected a specplan.Plan, got {type(given).__name__}")
    if given.text() != mine.text():
        raise ValueError(
            "plan: an engine runs the phases of the plan it registered; this plan differs "
            f"({given.name!r} vs the engine's {mine.name!r}): make an Engine for it"
        )


class DraftExtendRunner:
    """Runs a plan's draft-extend forward on an engine's memory: its arguments are `Engine`'s
    (the plan, its weights, the K/V pools, the table). `DraftExtendRunner(plan, weights, ...)`
    registers its own `Engine`; `engine.draft_extend()` makes one on an existing
    registration. The registered tensors must stay alive and in place for the runner's life
    (the engine keeps references to them).
    """

    def __init__(self, plan, weights, k_cache=None, v_cache=None, req_to_token=None, block_table=None, *,
                 kv_cache=None, kv_layout=None, block_size=None, gemms="cached", tp_group=None,
                 l2_prefetch="off"):
        self._attach(Engine(plan, weights, k_cache, v_cache, req_to_token, block_table, kv_cache=kv_cache,
                            kv_layout=kv_layout, block_size=block_size, gemms=gemms, tp_group=tp_group,
                            l2_prefetch=l2_prefetch))

    @classmethod
    def _on(cls, engine):
        r = cls.__new__(cls)
        r._attach(engine)
        return r

    def _attach(self, engine):
        torch = engine._torch
        plan = engine.plan
        self.engine = engine
        self.plan = plan
        self._torch = torch
        self._act = engine._act
        self._engine = engine._engine
        self._device, self._index, self._stream = engine._device, engine._index, engine._stream
        # Sizes and output dtypes from the phase's signature (specplan_format::signature).
        sig = {name: (dtype, shape, role) for name, dtype, shape, role, _ in plan._p.signature(1, "draft_extend")}
        self._sig = sig
        self._n = sig["input_ids"][1][0]
        self._hin = sig["hidden_states"][1][1]
        self._h = sig["hidden_out"][1][1]
        self._max_b = plan.max_requests
        self._max_ctx = plan.max_context_len
        self._emits_topk = "topk_ids" in sig
        self._emits_logits = "logits" in sig
        self._k = sig["topk_ids"][1][1] if self._emits_topk else plan.topk
        self._i32, self._i64 = torch.int32, torch.int64
        device = self._device
        r = self._max_b
        dt = lambda name: _TORCH_DTYPES(torch)[sig[name][0]]  # noqa: E731
        self._out_p = torch.empty((r, self._k), dtype=dt("topk_probs"), device=device) if self._emits_topk else None
        self._out_i = torch.empty((r, self._k), dtype=dt("topk_ids"), device=device) if self._emits_topk else None
        self._out_h = torch.empty((r, self._h), dtype=dt("hidden_out"), device=device)
        self._out_l = (
            torch.empty((r, sig["logits"][1][1]), dtype=dt("logits"), device=device) if self._emits_logits else None
        )
        self._views = {}

    # ---- per step ----

    def _ints(self, name, t, b):
        _need_tensor(self._torch, name, t)
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
            prefix_includes_new_tokens=False, accept_is_select_index=False, out=None):
        """One draft-extend step of b = len(req_pool_indices) requests, on the current stream;
        returns once it is enqueued (no host synchronization).

        input_ids         int64 or int32 [b*N] or [b, N]
        hidden_states     [b*N, H] or [b, N, H], the plan's dtype (the target's hidden states)
        req_pool_indices  int64/int32 [b]: rows of the registered table
        prefix_lens       int64/int32 [b]: tokens already cached per request (or SGLang's
                          seq_lens = prefix + N, with prefix_includes_new_tokens=True)
        accept_lens       int64/int32 [b]: accepted tokens per request, in [1, N]; or, with
                          accept_is_select_index=True, each request's selected row
                          r*N + A - 1 of the batch (SGLang's select_index, vLLM's
                          last_token_indices)
        prefix_lens_cpu   optional host copy of prefix_lens: checked here first, so a bad
                          length raises ValueError instead of being refused on the device
        out               optional dict of the caller's output tensors ("topk_p",
                          "topk_index", "hidden_states", "logits": contiguous, of the
                          plan's dtypes and shapes [b, ...], on the runner's device): the
                          device writes those outputs there instead of into the runner's
                          own buffers (no extra copy; such a tensor outlives later runs)
        """
        torch = self._torch
        if not isinstance(req_pool_indices, torch.Tensor):
            raise TypeError(f"req_pool_indices: expected a torch.Tensor, got {type(req_pool_indices).__name__}")
        if req_pool_indices.dim() != 1:
            raise ValueError(f"req_pool_indices: shape {tuple(req_pool_indices.shape)}, expected [b]")
        b = req_pool_indices.shape[0]
        req_i32 = self._ints("req_pool_indices", req_pool_indices, b)
        if not 0 < b <= self._max_b:
            raise ValueError(f"req_pool_indices: batch {b} is outside [1, {self._max_b}] (the plan's max_requests)")
        prefix_i32 = self._ints("prefix_lens", prefix_lens, b)
        accept_i32 = self._ints("accept_lens", accept_lens, b)
        n = self._n
        _need_tensor(torch, "input_ids", input_ids)
        if input_ids.dtype is not self._i64 and input_ids.dtype is not self._i32:
            raise TypeError(f"input_ids: dtype {input_ids.dtype}, expected torch.int64 or torch.int32")
        if tuple(input_ids.shape) not in ((b * n,), (b, n)):
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected [{b * n}] or [{b}, {n}]")
        if input_ids.get_device() != self._index or not input_ids.is_contiguous():
            raise ValueError(f"input_ids: must be contiguous on {self._device} (is on {input_ids.device})")
        _need_tensor(torch, "hidden_states", hidden_states)
        if hidden_states.dtype is not self._act:
            raise TypeError(f"hidden_states: dtype {hidden_states.dtype}, the plan's activations are {self._act}")
        hin = self._hin
        if tuple(hidden_states.shape) not in ((b * n, hin), (b, n, hin)):
            raise ValueError(
                f"hidden_states: shape {tuple(hidden_states.shape)}, expected [{b * n}, {hin}] or [{b}, {n}, {hin}]"
            )
        if hidden_states.get_device() != self._index or not hidden_states.is_contiguous():
            raise ValueError(f"hidden_states: must be contiguous on {self._device} (is on {hidden_states.device})")
        if not isinstance(prefix_includes_new_tokens, bool):
            raise TypeError(
                f"prefix_includes_new_tokens: expected a bool, got {type(prefix_includes_new_tokens).__name__}"
            )
        bias = -n if prefix_includes_new_tokens else 0
        if prefix_lens_cpu is not None:
            self._check_lengths(prefix_lens_cpu, b, bias)
        if out is None:
            # The runner's own buffers: their addresses never change (no per-step slicing).
            dst, ptrs = None, self._own_ptrs()
        else:
            dst = self._outputs(out, b)
            ptrs = tuple(0 if t is None else t.data_ptr() for t in dst)
        if not isinstance(accept_is_select_index, bool):
            raise TypeError(f"accept_is_select_index: expected a bool, got {type(accept_is_select_index).__name__}")
        self._engine.step(
            b, input_ids.data_ptr(), input_ids.dtype is self._i32, hidden_states.data_ptr(),
            req_pool_indices.data_ptr(), req_i32, prefix_lens.data_ptr(), prefix_i32, bias,
            accept_lens.data_ptr(), accept_i32, accept_is_select_index, *ptrs, self._stream(),
        )
        if dst is not None:
            return DraftExtendOutput(*dst)
        views = self._views.get(b)
        if views is None:
            view = lambda t: None if t is None else t[:b]  # noqa: E731
            views = DraftExtendOutput(view(self._out_p), view(self._out_i), self._out_h[:b], view(self._out_l))
            self._views[b] = views
        return views

    def _own_ptrs(self):
        p = getattr(self, "_own", None)
        if p is None:
            ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
            p = (ptr(self._out_p), ptr(self._out_i), self._out_h.data_ptr(), ptr(self._out_l))
            self._own = p
        return p

    def _outputs(self, out, b):
        """(topk_p, topk_index, hidden_states, logits) for a step of b: the caller's tensors
        where `out` gives them (checked), else views of the runner's own buffers."""
        view = lambda t: None if t is None else t[:b]  # noqa: E731
        own = [view(self._out_p), view(self._out_i), self._out_h[:b], view(self._out_l)]
        if out is None:
            return own
        if not isinstance(out, dict):
            raise TypeError(f"out: expected a dict of output tensors, got {type(out).__name__}")
        torch = self._torch
        names = ("topk_p", "topk_index", "hidden_states", "logits")
        dtypes = tuple(
            _TORCH_DTYPES(torch)[self._sig[s][0]] if s in self._sig else None
            for s in ("topk_probs", "topk_ids", "hidden_out", "logits")
        )
        for key in out:
            if key not in names:
                raise ValueError(f"out: unknown output {key!r} (expected {', '.join(names)})")
        for i, (name, dt) in enumerate(zip(names, dtypes)):
            t = out.get(name)
            if t is None:
                continue
            what = f"out[{name!r}]"
            _need_tensor(torch, what, t)
            if own[i] is None:
                raise ValueError(f"{what}: the plan does not emit it (outputs={self.plan.outputs})")
            want = (b,) + tuple(own[i].shape[1:])
            if t.dtype != dt or tuple(t.shape) != want:
                raise ValueError(f"{what}: {t.dtype} {tuple(t.shape)}, expected {dt} {want}")
            if t.get_device() != self._index or not t.is_contiguous():
                raise ValueError(f"{what}: must be contiguous on {self._device}")
            own[i] = t
        return own

    def _check_lengths(self, lens, b, bias):
        values = lens.tolist() if hasattr(lens, "tolist") else list(lens)
        if len(values) != b:
            raise ValueError(f"prefix_lens_cpu: {len(values)} values, expected {b}")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"prefix_lens_cpu[{i}]: expected an integer, got {type(v).__name__}")
            prefix = v + bias
            if prefix < 0 or prefix + self._n > self._max_ctx:
                raise ValueError(
                    f"prefix_lens_cpu[{i}]: prefix {prefix} puts positions {prefix}..{prefix + self._n - 1} outside [0, {self._max_ctx}) (the plan's max_context_len)"
                )

    def can_run(self, batch_size):
        """Whether a captured graph serves this batch size."""
        batch_size = _int_arg("batch_size", batch_size)
        return 0 < batch_size < 2**32 and self._engine.can_run(batch_size)

    @property
    def device(self):
        return self._device

    def last_error(self):
        """None, or the DeviceError of the last step (waits for that step to finish)."""
        e = self._engine.last_error()
        return None if e is None else DeviceError(*e)

    def poll_error(self):
        """Without waiting: `(errors, pending)` — a DeviceError for each step that finished
        since the last poll and refused a request (oldest first), and whether a later step
        is still running (it is reported by a later poll). No synchronization, no copy."""
        refusals, pending, lost = self._engine.poll_error()
        errors = [DeviceError(*e) for e in refusals]
        if lost:
            errors.append(DeviceError(lost, -1, f"{lost} unpolled step(s) were overwritten in the refusal ring "
                                                f"before a poll: what they refused is unknown (poll at least "
                                                f"every 16 steps)"))
        return errors, pending

    def load_times(self):
        """Load time split (ms): setup, GEMM choice, graph capture, total."""
        return self._engine.load_times()
