"""DraftDecodeRunner: a plan's draft-decode phase (one step-count tier, `draft_decode:S`) on
an engine's registration: the S − 1 draft forwards of b·topk rows after draft-extend, the
K/V of every lane written to the slots the engine's table gives (lane k's forward i at
position L + lane_offset(k) + i, SGLang 0.5.23's layout), and the tree SGLang's draft-decode
slot returns: parent_list, top_scores_index, draft_tokens (int64, target ids).

Every tensor is checked on the host before anything runs (dtype, shape, device, contiguity;
the error names it); each request is checked again by the engine's rules (table row, the
prefix and its lanes' reach within max_context_len, the lanes' slots, the ids, no lane slot
another request reads), and a request breaking one writes nothing and gets zero rows
(`last_error()`; on CUDA tensors the rules run on the device, and the draft-extend runner's
`poll_error()` reports either phase's refusals without waiting: they share one ring).
"""

from ._runner import DeviceError, _TORCH_DTYPES, _int_arg, _need_tensor


_VERIFY = ("verify_tokens", "verify_positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")


class DraftDecodeOutput:
    """One step's tree: views of the runner's own int64 buffers `[b, ·]`, valid until its
    next `run` (as SGLang's graph runner outputs). With a plan compiled with
    `draft_decode_outputs="tree,verify"` also the target's verify inputs (else None):
    `verify_tokens`, `verify_positions`, `retrieve_index`, `retrieve_next_token`,
    `retrieve_next_sibling` int64 [b, N] and `tree_mask` int32 [b, N, N] (1: the row's node
    attends the column's: itself and its ancestors)."""

    __slots__ = ("parent_list", "top_scores_index", "draft_tokens") + _VERIFY + ("tree_mask",)

    def __init__(self, parent_list, top_scores_index, draft_tokens, verify=None, tree_mask=None):
        self.parent_list, self.top_scores_index, self.draft_tokens = parent_list, top_scores_index, draft_tokens
        for name, t in zip(_VERIFY, verify or (None,) * len(_VERIFY)):
            setattr(self, name, t)
        self.tree_mask = tree_mask

    def __iter__(self):
        return iter((self.parent_list, self.top_scores_index, self.draft_tokens))

    def __repr__(self):
        return (f"DraftDecodeOutput(parent_list={tuple(self.parent_list.shape)}, "
                f"top_scores_index={tuple(self.top_scores_index.shape)}, draft_tokens={tuple(self.draft_tokens.shape)})")


def _phase_label(plan, steps):
    tiers = [int(label.split(":")[1]) for label, _, _ in plan.phases() if label.startswith("draft_decode:")]
    if not tiers:
        raise ValueError("plan: it has no draft-decode phase (compile it with draft_decode_steps=)")
    if steps is None:
        steps = plan.num_steps if plan.num_steps in tiers else (tiers[0] if len(tiers) == 1 else None)
        if steps is None:
            raise ValueError(f"steps: the plan has the tiers {tiers}; name one")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps not in tiers:
        raise ValueError(f"steps {steps!r}: the plan's draft-decode tiers are {tiers}")
    return f"draft_decode:{steps}", steps


class DraftDecodeRunner:
    """Runs one draft-decode tier of a plan on an engine's memory; made by
    `engine.draft_decode(steps=S)` (one per engine and tier)."""

    @classmethod
    def _on(cls, engine, steps):
        r = cls.__new__(cls)
        torch = engine._torch
        plan = engine.plan
        r.engine, r.plan, r._torch = engine, plan, torch
        r._label, r.steps = _phase_label(plan, steps)
        r._engine = engine._engine
        r._device, r._index, r._stream = engine._device, engine._index, engine._stream
        sig = {name: (dtype, shape) for name, dtype, shape, _, _ in plan._p.signature(1, r._label)}
        r._k = sig["topk_ids"][1][1]
        r._h = sig["hidden_states"][1][1]
        r._pw = sig["parent_list"][1][1]
        r._nodes = sig["draft_tokens"][1][1]
        r._act = engine._act
        r._max_b = plan.max_requests
        r._i32, r._i64 = torch.int32, torch.int64
        rows = r._max_b
        dev = r._device
        r._parents = torch.empty((rows, r._pw), dtype=torch.int64, device=dev)
        r._index_buf = torch.empty((rows, r._nodes), dtype=torch.int64, device=dev)
        r._tokens = torch.empty((rows, r._nodes), dtype=torch.int64, device=dev)
        r._verify = "verify_tokens" in sig
        n = r._nodes + 1
        r._verify_bufs = (tuple(torch.empty((rows, n), dtype=torch.int64, device=dev) for _ in _VERIFY)
                          if r._verify else None)
        r._mask = torch.empty((rows, n, n), dtype=torch.int32, device=dev) if r._verify else None
        r._f32 = _TORCH_DTYPES(torch)["f32"]
        r._views = {}
        return r

    @property
    def num_draft_tokens(self):
        """N of this tier (its tree has N − 1 nodes besides the root)."""
        return self._nodes + 1

    def _tensor(self, name, t, dtypes, shape):
        _need_tensor(self._torch, name, t)
        if t.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise TypeError(f"{name}: dtype {t.dtype}, expected {want}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {list(shape)}")
        if t.get_device() != self._index or not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous on {self._device} (is on {t.device})")
        return t.dtype is self._i32

    def run(self, topk_p, topk_index, hidden_states, req_pool_indices, prefix_lens, *, prefix_bias=0,
            bonus_tokens=None):
        """One draft-decode step of b = len(req_pool_indices) requests.

        topk_p            float32 [b, K]: draft-extend's top-K probabilities (1.0 for topk 1)
        topk_index        int64/int32 [b, K]: draft-extend's top-K ids, in the target
                          vocabulary (map a hot or draft vocabulary once before: the phase
                          maps each later step's ids itself)
        hidden_states     [b, H], the plan's dtype: draft-extend's hidden row (EAGLE-3:
                          before the final norm)
        req_pool_indices  int64/int32 [b]: rows of the registered table
        prefix_lens       int64/int32 [b]: tokens cached per request (SGLang's seq_lens);
                          `prefix_bias` is added to each
        bonus_tokens      int64/int32 [b]: the verified bonus tokens, the trees' roots (plans
                          with the verify inputs only, where it is required)
        Returns a DraftDecodeOutput (views valid until the next run).
        """
        torch = self._torch
        if not isinstance(req_pool_indices, torch.Tensor):
            raise TypeError(f"req_pool_indices: expected a torch.Tensor, got {type(req_pool_indices).__name__}")
        if req_pool_indices.dim() != 1:
            raise ValueError(f"req_pool_indices: shape {tuple(req_pool_indices.shape)}, expected [b]")
        b = req_pool_indices.shape[0]
        if not 0 < b <= self._max_b:
            raise ValueError(f"req_pool_indices: batch {b} is outside [1, {self._max_b}] (the plan's max_requests)")
        ints = (self._i64, self._i32)
        req_i32 = self._tensor("req_pool_indices", req_pool_indices, ints, (b,))
        prefix_i32 = self._tensor("prefix_lens", prefix_lens, ints, (b,))
        ids_i32 = self._tensor("topk_index", topk_index, ints, (b, self._k))
        self._tensor("topk_p", topk_p, (self._f32,), (b, self._k))
        self._tensor("hidden_states", hidden_states, (self._act,), (b, self._h))
        prefix_bias = _int_arg("prefix_bias", prefix_bias)
        if not -(2**31) <= prefix_bias < 2**31:
            raise ValueError(f"prefix_bias: {prefix_bias} is outside the int32 range")
        extra = {}
        if self._verify:
            if bonus_tokens is None:
                raise ValueError("bonus_tokens: the plan emits the verify inputs (draft_decode_outputs tree,verify) "
                                 "and needs the trees' roots")
            bonus_i32 = self._tensor("bonus_tokens", bonus_tokens, ints, (b,))
            extra = dict(bonus=bonus_tokens.data_ptr(), bonus_i32=bonus_i32,
                         out_verify=[t.data_ptr() for t in self._verify_bufs], out_mask=self._mask.data_ptr())
        elif bonus_tokens is not None:
            raise ValueError("bonus_tokens: the plan emits no verify inputs (compile it with "
                             "draft_decode_outputs=\"tree,verify\")")
        self._engine.draft_decode(
            self._label, b, topk_p.data_ptr(), topk_index.data_ptr(), ids_i32, hidden_states.data_ptr(),
            req_pool_indices.data_ptr(), req_i32, prefix_lens.data_ptr(), prefix_i32, prefix_bias,
            self._parents.data_ptr(), self._index_buf.data_ptr(), self._tokens.data_ptr(), self._stream(), **extra,
        )
        views = self._views.get(b)
        if views is None:
            verify = tuple(t[:b] for t in self._verify_bufs) if self._verify else None
            views = DraftDecodeOutput(self._parents[:b], self._index_buf[:b], self._tokens[:b], verify,
                                      self._mask[:b] if self._verify else None)
            self._views[b] = views
        return views

    def can_run(self, batch_size):
        """Whether the tier serves this batch: every batch up to max_requests (above the
        largest bucket in chunks of it; on CUDA tensors each chunk replays that bucket's
        graph)."""
        batch_size = _int_arg("batch_size", batch_size)
        return 0 < batch_size <= self._max_b

    @property
    def device(self):
        return self._device

    def last_error(self):
        """None, or the DeviceError of the last step of any phase."""
        e = self._engine.last_error()
        return None if e is None else DeviceError(*e)
