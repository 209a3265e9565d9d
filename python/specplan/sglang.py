"""specplan in SGLang 0.5.23's EAGLE worker (`EAGLEWorkerV2` / `EagleDraftWorker`).

Two ways in, both through `install`:

1. The draft-extend slot, SGLang's own contract (`EagleDraftWorker.
   cuda_graph_runner_for_draft_extend`): `can_run_graph(forward_batch)` and
   `execute(forward_batch, select_index)`, which returns a `LogitsProcessorOutput` whose
   `.next_token_logits` are the selected rows' float32 logits `[bs, V_d]` (draft or hot
   vocabulary, ids unmapped) and `.hidden_states` the selected rows `[bs, H]` (EAGLE-1: h +
   residual; EAGLE-3: before the final norm). SGLang then samples (top-k, argmax for topk = 1,
   rejection sampling) and maps ids through `hot_token_id` itself. The plan must emit logits
   (`outputs="logits"`, or `"topk-draft,logits"` with the fused path). The lm_head runs on the
   bs selected rows only.

2. The fused path (`fused=True`): `EagleDraftWorker._draft_extend_for_decode` is replaced on
   the worker by a method that takes specplan's fused top-K (`outputs` with "topk-draft": ids
   left in the lm_head's vocabulary, which SGLang's `draft_forward` maps through
   `hot_token_id`, so no id is mapped twice; `topk_p = 1` for topk = 1, as SGLang sets it) and
   writes `next_draft_input` directly: no logits, no torch top-k, no ForwardBatch. Every mode it
   does not cover (rejection sampling, DSA, a canary, ROCm, a batch the plan's graphs do not
   serve) runs SGLang's own method unchanged — which then uses the slot runner above when the
   plan also emits logits.

    import specplan, specplan.sglang
    plan = specplan.Plan.compile(hf_config="draft/config.json", speculative_eagle_topk=1,
                                 speculative_num_steps=3, speculative_num_draft_tokens=4,
                                 page_size=1, max_context_len=8192, outputs="topk-draft,logits")
    # after the scheduler has started (Scheduler.init_model_worker, which captures graphs):
    specplan.sglang.install(scheduler, plan, fused=True)

`install` finds the `EagleDraftWorker` (from a Scheduler, an EAGLEWorkerV2 or the worker
itself), registers the draft model's KV pool (`MHATokenToKVPool`, NHD or HND, any page size),
the shared `req_to_token` table and the draft module's parameters in place (SGLang's names:
`model.layers.{i}.self_attn.qkv_proj.weight`, EAGLE-3's `model.layers.0.*`, its
`hot_token_id`), and sets the slot on the worker and on every adaptive-speculation tier whose
`num_draft_tokens` equals the plan's (other tiers keep SGLang's runners).

Launches go on the current stream; `draft_runner.shared_read_done_event` is set to an event
recorded after the step (so the scheduler's write-after-read barrier waits for exactly this
step). A request the device-side checks refuse (its row, lengths or slots inconsistent with
the registered table) writes nothing and gets a zero draft, and is reported through SGLang's
logging (`sglang.srt.speculative.specplan`) with its index when the next step starts (read
without a wait from host-mapped memory).
"""

import logging
import types

from ._runner import DraftExtendRunner, Engine

SGLANG_VERSION = "0.5.23"

logger = logging.getLogger("sglang.srt.speculative.specplan")


def _sglang_version():
    try:
        import sglang

        return getattr(sglang, "__version__", None)
    except ImportError:
        return None


def _logits_output_class():
    try:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        return LogitsProcessorOutput
    except ImportError:  # pragma: no cover - without SGLang: a plain record with the fields
        return types.SimpleNamespace


class SGLangDraftExtendRunner:
    """SGLang's draft-extend slot over a `DraftExtendRunner` registered on SGLang's memory."""

    def __init__(self, runner, *, draft_runner=None, dp_attention=False, disable_padding=False):
        if not isinstance(runner, DraftExtendRunner):
            raise TypeError(f"runner: expected a specplan.DraftExtendRunner, got {type(runner).__name__}")
        plan = runner.plan
        self.runner = runner
        self.plan = plan
        self.draft_runner = draft_runner
        self._n = plan.num_draft_tokens
        self._hin = plan.hidden_in_size
        self._buckets = list(plan.graph_buckets)
        self._max_bs = max(self._buckets) if self._buckets else 0
        self._ctx = plan.max_context_len
        self._dp = bool(dp_attention)
        self._exact = bool(disable_padding)
        self._emits_logits = "logits" in plan.outputs.split(",")
        self._cuda = runner.device.type == "cuda"
        self._logits_cls = _logits_output_class()
        self._pending = False
        self._logged = set()
        # What SGLang's own runner exposes that its callers read.
        self.captured_req_width = self._n

    def _once(self, key, msg, *args):
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

    # ---- the slot contract ----

    def can_run_graph(self, forward_batch):
        """SGLang's gating for its own draft-extend graphs, plus what the plan serves: the
        batch's width is the plan's N, no DP attention, a batch size a graph serves (exactly
        one, with SGLang's `disable_cuda_graph_padding`), the plan's hidden dtype and width,
        and, where SGLang has the lengths on the host, contexts within the plan's."""
        if not self._emits_logits:
            return False
        spec = getattr(forward_batch, "spec_info", None)
        if spec is None or getattr(spec, "num_tokens_per_req", self._n) != self._n:
            return False
        if self._dp:
            self._once("dp", "specplan: DP attention is not supported; SGLang's own draft-extend runs")
            return False
        bs = forward_batch.seq_lens.numel()
        if bs == 0 or bs > self._max_bs or (self._exact and bs not in self._buckets):
            return False
        if not self.runner.can_run(bs):
            return False
        hidden = spec.hidden_states
        if hidden is None or hidden.dtype != self.runner._act or hidden.shape[-1] != self._hin:
            self._once("hidden", "specplan: target hidden states %s do not match the plan's %s x %d",
                       None if hidden is None else (hidden.dtype, tuple(hidden.shape)), self.runner._act, self._hin)
            return False
        cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if cpu is not None and int(cpu.max()) > self._ctx:
            return False
        return True

    def execute(self, forward_batch, select_index):
        """Runs the step: K/V for all bs·N rows at the slots `req_to_token` names (the batch's
        `out_cache_loc`), the selected rows' logits and hidden states returned. Enqueued on
        the current stream; nothing waits."""
        self.report()
        spec = forward_batch.spec_info
        bs = forward_batch.seq_lens.numel()
        torch = self.runner._torch
        # A fresh hidden tensor per step: SGLang keeps it (next_draft_input) past later steps.
        hidden = torch.empty((bs, self.plan.hidden_size), dtype=self.runner._act, device=self.runner.device)
        out = self.runner.run(
            forward_batch.input_ids,
            spec.hidden_states,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            select_index,
            prefix_includes_new_tokens=True,
            accept_is_select_index=True,
            out={"hidden_states": hidden},
        )
        self._publish_read_done()
        return self._logits_cls(next_token_logits=out.logits, hidden_states=hidden)

    # ---- helpers ----

    def _publish_read_done(self):
        """The scheduler's WAR barrier waits on this event (or, when None, on the whole
        forward stream): recorded after the step, it covers every read of shared buffers."""
        if self.draft_runner is None:
            return
        if self._cuda:
            torch = self.runner._torch
            ev = torch.cuda.Event()
            ev.record()
            self.draft_runner.shared_read_done_event = ev
        else:
            self.draft_runner.shared_read_done_event = None

    def report(self):
        """Logs, through SGLang's logging, what the device refused in the steps that have
        finished since the last report (no wait, no copy). Returns the DeviceErrors."""
        errors, pending = self.runner.poll_error()
        for e in errors:
            logger.error("specplan draft-extend: %s", e)
        self._pending = pending
        return errors

    # ---- construction ----

    @classmethod
    def from_draft_worker(cls, draft_worker, plan, *, gemms="cached", l2_prefetch="off"):
        """Registers a started `EagleDraftWorker`'s memory: its draft model runner's KV pool,
        the shared `req_to_token` and the draft model's parameters (and `hot_token_id`)."""
        dr = draft_worker.draft_runner
        pools, layout, table = _memory(draft_worker, plan)
        weights = _weights(draft_worker, plan)
        # One registration of SGLang's memory; the draft-extend phase runs on it (a later
        # phase of the same plan would share it: `engine.<phase>()`).
        sa = getattr(draft_worker, "server_args", None)
        tp_group = _sglang_tp(plan, sa, draft_worker)
        engine = Engine(
            plan, weights, [k for k, _ in pools], [v for _, v in pools], req_to_token=table,
            kv_layout=layout, gemms=gemms, tp_group=tp_group, l2_prefetch=l2_prefetch,
        )
        runner = engine.draft_extend()
        return cls(
            runner,
            draft_runner=dr,
            dp_attention=bool(getattr(sa, "enable_dp_attention", False)),
            disable_padding=bool(getattr(sa, "disable_cuda_graph_padding", False)),
        )


def _sglang_tp(plan, server_args, draft_worker):
    """SGLang 0.5.23's draft runs with the target's tp_size (server_args.tp_size; this rank's
    get_tensor_model_parallel_rank()): a sharded plan of that rank and its NCCL group
    (get_tp_group(), srt/distributed/parallel_state.py:2228, 3196)."""
    from ._runner import _engine_tp

    def group():
        from sglang.srt.distributed import get_tp_group

        return get_tp_group()

    size = int(getattr(server_args, "tp_size", 1) or 1) if server_args is not None else 1
    rank = 0
    if size > 1:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    return _engine_tp(plan, "SGLang", size, rank, group)


def _decode_reach(L, steps, topk, page):
    """Positions past the prefix L a request's draft-decode lanes touch (the plan's
    `decode_reach`: lane k's run starts k·S past L, or k page-aligned runs with pages)."""
    if page == 1 or topk == 1:
        off = (topk - 1) * steps
    else:
        off = (topk - 1) * ((L % page + steps + page - 1) // page) * page
    return off + steps - 1


class SGLangDraftDecodeRunner:
    """SGLang's draft-decode slot (`EagleDraftWorker.cuda_graph_runner`: `can_run_graph`,
    `execute(forward_batch)` -> (parent_list, top_scores_index, draft_tokens, draft_probs))
    over a `DraftDecodeRunner` of one step-count tier, on the registration the draft-extend
    slot made. The batch's draft-extend ids are mapped through `hot_token_id` once, as
    `draft_forward` maps them (W2:757-758); the phase maps every later step's ids itself.
    The K/V of each lane goes to the slots `req_to_token` names past `seq_lens` (what
    `prepare_for_draft` gathered into `out_cache_loc`), so `out_cache_loc` is not read."""

    def __init__(self, runner, *, hot_token_id=None, draft_runner=None, dp_attention=False, disable_padding=False):
        from ._decode import DraftDecodeRunner

        if not isinstance(runner, DraftDecodeRunner):
            raise TypeError(f"runner: expected a specplan.DraftDecodeRunner, got {type(runner).__name__}")
        plan = runner.plan
        self.runner, self.plan, self.steps = runner, plan, runner.steps
        self.hot_token_id = hot_token_id
        self.draft_runner = draft_runner
        self._k = plan.topk
        self._h = plan.hidden_size
        self._page = plan.page_size
        self._ctx = plan.max_context_len
        self._buckets = [b for label, _, buckets in plan.phases() if label == runner._label for b in buckets]
        self._max_bs = max(self._buckets) if self._buckets else 0
        self._dp = bool(dp_attention)
        self._exact = bool(disable_padding)
        self._logged = set()
        # What SGLang's own runner exposes (GR:159): the batch width it serves.
        self.captured_req_width = self._k

    def _once(self, key, msg, *args):
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

    def can_run_graph(self, forward_batch):
        """SGLang's gates for its draft-decode graphs (the batch's width is topk, a batch
        size the tier's buckets serve, exactly one with `disable_cuda_graph_padding`) and what
        the phase covers: no rejection sampling (it returns no draft probabilities), no DP
        attention, draft-extend's tensors in the plan's dtypes and widths, and, where SGLang
        has host lengths, every request's lanes within the plan's max_context_len."""
        spec = getattr(forward_batch, "spec_info", None)
        if spec is None:
            return False
        width = getattr(spec, "num_tokens_per_req", self._k)
        if width is not None and width > 0 and width != self._k:
            return False
        if self._dp:
            self._once("dp", "specplan: DP attention is not supported; SGLang's own draft decode runs")
            return False
        try:
            from sglang.srt.runtime_context import get_spec

            if get_spec().speculative_use_rejection_sampling:
                self._once("rs", "specplan: rejection sampling needs the draft probabilities; SGLang's own "
                                 "draft decode runs")
                return False
        except ImportError:  # pragma: no cover - without SGLang there is no such mode
            pass
        bs = forward_batch.seq_lens.numel()
        if bs == 0 or bs > self._max_bs or (self._exact and bs not in self._buckets):
            return False
        if not self.runner.can_run(bs):
            return False
        torch = self.runner._torch
        hidden, p, ids = spec.hidden_states, spec.topk_p, spec.topk_index
        if hidden is None or hidden.dtype != self.runner._act or tuple(hidden.shape) != (bs, self._h):
            self._once("hidden", "specplan: draft hidden states %s do not match the plan's %s x %d",
                       None if hidden is None else (hidden.dtype, tuple(hidden.shape)), self.runner._act, self._h)
            return False
        if p is None or p.dtype != torch.float32 or tuple(p.shape) != (bs, self._k):
            return False
        if ids is None or ids.dtype not in (torch.int64, torch.int32) or tuple(ids.shape) != (bs, self._k):
            return False
        if self.runner._verify and getattr(spec, "bonus_tokens", None) is None:
            return False
        cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if cpu is not None:
            for L in cpu.tolist():
                if L + _decode_reach(L, self.steps, self._k, self._page) > self._ctx:
                    return False
        return True

    def execute(self, forward_batch):
        """The tier's S − 1 forwards and the tree; returns SGLang's four values (views valid
        until the next execute, as SGLang's graph outputs; no draft probabilities)."""
        spec = forward_batch.spec_info
        ids = spec.topk_index
        if self.hot_token_id is not None:
            ids = self.hot_token_id[ids]
        # A plan with the verify inputs computes them from the bonus roots too (SGLang builds
        # its own after the slot: they are there for a caller that reads them).
        bonus = getattr(spec, "bonus_tokens", None) if self.runner._verify else None
        out = self.runner.run(
            spec.topk_p.contiguous(),
            ids.contiguous(),
            spec.hidden_states.contiguous(),
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            bonus_tokens=None if bonus is None else bonus.contiguous(),
        )
        if self.runner.device.type == "cpu":
            e = self.runner.last_error()
            if e is not None:
                logger.error("specplan draft-decode: %s", e)
        # On CUDA nothing waits here: the engine's refusal ring holds both phases' steps, and
        # the draft-extend slot's `report()` (no wait, no copy) logs them.
        if self.draft_runner is not None:
            self.draft_runner.shared_read_done_event = None
        return out.parent_list, out.top_scores_index, out.draft_tokens, None


# ---- what install reads from SGLang ----


def _find_draft_worker(target):
    """(EAGLEWorkerV2 or None, EagleDraftWorker) from a Scheduler, an EAGLEWorkerV2 or an
    EagleDraftWorker."""
    if hasattr(target, "cuda_graph_runner_for_draft_extend") and hasattr(target, "draft_runner"):
        return None, target
    for name in ("draft_worker", "model_worker"):
        w = getattr(target, name, None)
        if w is None:
            continue
        inner = getattr(w, "draft_worker", None)
        if inner is not None and hasattr(inner, "cuda_graph_runner_for_draft_extend") and hasattr(inner, "draft_runner"):
            return w, inner
        if hasattr(w, "cuda_graph_runner_for_draft_extend") and hasattr(w, "draft_runner"):
            return target, w
    raise TypeError(
        f"{type(target).__name__}: no EagleDraftWorker found (expected a Scheduler with .draft_worker, "
        "an EAGLEWorkerV2 or an EagleDraftWorker; multi-layer (MTP) and STANDALONE workers are not supported)"
    )


def _memory(dw, plan):
    """Per-layer (K, V) tensors, their kv_layout and the `req_to_token` table."""
    pool = dw.draft_runner.token_to_kv_pool
    kind = type(pool).__name__
    if kind != "MHATokenToKVPool":
        raise ValueError(
            f"draft_runner.token_to_kv_pool: {kind} is not supported (MHATokenToKVPool only; unified, SWA, "
            "MLA and fused-draft pools translate slots)"
        )
    kb, vb = list(pool.k_buffer), list(pool.v_buffer)
    if len(kb) != plan.num_layers:
        raise ValueError(f"draft KV pool: {len(kb)} layers, the plan has {plan.num_layers}")
    layout = "HND" if kb[0].dim() == 4 else None
    table = dw.req_to_token_pool.req_to_token
    if table.shape[1] > plan.max_context_len:
        logger.warning(
            "specplan: req_to_token has %d columns, the plan's max_context_len is %d: longer requests fall "
            "back to SGLang's own draft-extend (or are refused when SGLang has no host lengths)",
            table.shape[1], plan.max_context_len,
        )
    return list(zip(kb, vb)), layout, table


def _weights(dw, plan):
    """The draft module's tensors under the plan's names, in place."""
    model = dw.draft_runner.model
    torch_mod = type(model).__name__
    eagle3 = plan.head == "eagle3"
    want = "LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"
    if torch_mod != want:
        raise ValueError(f"draft model: {torch_mod}, the plan is an {plan.head} head ({want})")
    params = {n: p.data for n, p in model.named_parameters()}
    out = {}
    for name, t in params.items():
        n = name[len("model."):] if name.startswith("model.") else name
        if eagle3 and n.startswith("layers.0."):
            n = "midlayer." + n[len("layers.0."):]
        out[n] = t
    # Embedding and head by attribute: a tied target yields the shared tensor once.
    out["embed_tokens.weight"] = model.model.embed_tokens.weight.data
    out["lm_head.weight"] = model.lm_head.weight.data
    for n, t in list(out.items()):
        if n.endswith("self_attn.qkv_proj.bias") or n.endswith("self_attn.o_proj.bias"):
            # SGLang creates attention biases when the config says `bias`; a checkpoint
            # without them leaves zeros, which the plan's forward matches.
            if bool(t.count_nonzero()):
                raise ValueError(f"draft model: {n} is not zero; attention biases are not supported")
            del out[n]
    if "fc.bias" in out and not plan.fc_bias:
        raise ValueError("draft model: it has fc.bias, the plan has none (compile with bias = true)")
    for n in out:
        if n.startswith("fc_norm") or n.startswith("input_norm"):
            raise ValueError(f"draft model: {n} (norm before fc) is not supported")
    hot = getattr(dw, "hot_token_id", None)
    names = {w[0] for w in plan.weights()}
    if plan.hot_vocab_size is not None:
        # FR-Spec: SGLang's draft head already holds the hot rows.
        out["lm_head.hot"] = out.pop("lm_head.weight")
        if "hot_token_ids" in names:
            if hot is None:
                raise ValueError("draft worker: the plan maps FR-Spec ids but hot_token_id is None")
            out["hot_token_ids"] = hot.to(dtype=_torch().int64).contiguous()
    if "d2t" in names:
        if hot is None:
            raise ValueError("draft worker: the plan maps EAGLE-3 ids (d2t) but hot_token_id is None")
        torch = _torch()
        vd = hot.shape[0]
        out["d2t"] = (hot.to(torch.int64) - torch.arange(vd, dtype=torch.int64, device=hot.device)).contiguous()
    return out


def _torch():
    import torch

    return torch


def _install_decode(dw, ac, slot, decode):
    """The plan's draft-decode tiers as SGLang's draft-decode slots: on the worker when its
    num_steps is one, and on every adaptive tier state whose num_steps is one (SGLang swaps
    `cuda_graph_runner` per tier, W2:1884). On CUDA tensors each tier replays its graphs on
    the engine's memory (`admit_decode` checks every request on the device)."""
    plan = slot.plan
    tiers = [int(label.split(":")[1]) for label, _, _ in plan.phases() if label.startswith("draft_decode:")]
    if not decode or not tiers:
        return {}
    engine = slot.runner.engine
    sa = getattr(dw, "server_args", None)
    runners = {
        s: SGLangDraftDecodeRunner(
            engine.draft_decode(s), hot_token_id=getattr(dw, "hot_token_id", None), draft_runner=dw.draft_runner,
            dp_attention=bool(getattr(sa, "enable_dp_attention", False)),
            disable_padding=bool(getattr(sa, "disable_cuda_graph_padding", False)),
        )
        for s in tiers
    }
    steps = getattr(dw, "speculative_num_steps", None)
    if steps in runners:
        dw.cuda_graph_runner = runners[steps]
    if ac is not None:
        for s, st in getattr(ac, "_states", {}).items():
            if s in runners and hasattr(st, "cuda_graph_runner"):
                st.cuda_graph_runner = runners[s]
    logger.info("specplan: draft decode installed for tiers %s", sorted(runners))
    return runners


# ---- the fused path ----


def _fused_draft_extend(self, batch, batch_result, *, kv_loc_plan=None):
    """`EagleDraftWorker._draft_extend_for_decode` with specplan's fused top-K: the same
    inputs SGLang's method reads (the verify result's ids, accept lengths and hidden states,
    the batch's rows and lengths), the same fields written to `next_draft_input`. Falls back
    to SGLang's method for every mode it does not cover."""
    f = self._specplan_fused
    if not f.covers(self, batch, batch_result):
        return f.original(batch, batch_result, kv_loc_plan=kv_loc_plan)
    f.slot.report()
    torch = f.runner._torch
    bs = batch.seq_lens.numel()
    dev = f.runner.device
    hidden = torch.empty((bs, f.runner.plan.hidden_size), dtype=f.runner._act, device=dev)
    topk_index = torch.empty((bs, f.topk), dtype=torch.int64, device=dev)
    outs = {"hidden_states": hidden, "topk_index": topk_index}
    if f.topk > 1:
        topk_p = torch.empty((bs, f.topk), dtype=torch.float32, device=dev)
        outs["topk_p"] = topk_p
    else:
        # SGLang's topk = 1: the argmax with probability one.
        topk_p = torch.ones((bs, 1), dtype=torch.float32, device=dev)
    f.runner.run(
        batch_result.next_token_ids,
        batch_result.logits_output.hidden_states,
        batch.req_pool_indices,
        batch.seq_lens,
        batch_result.accept_lens,
        out=outs,
    )
    f.slot._publish_read_done()
    nd = batch_result.next_draft_input
    nd.topk_p, nd.topk_index, nd.hidden_states = topk_p, topk_index, hidden
    nd.cuda_graph_compatible = True


class _Fused:
    """What the fused method needs: the runner, SGLang's original method, the slot runner
    (for reports and the read-done event) and the modes it covers."""

    def __init__(self, worker, slot, original):
        self.slot = slot
        self.runner = slot.runner
        self.original = original
        self.topk = worker.topk
        plan = slot.plan
        parts = plan.outputs.split(",")
        if "topk-draft" not in parts:
            raise ValueError(
                f"fused=True: the plan's outputs are {plan.outputs!r}; compile it with outputs=\"topk-draft\" "
                "(ids in the lm_head's vocabulary, which SGLang maps through hot_token_id) or "
                "\"topk-draft,logits\""
            )
        if plan.topk != worker.topk:
            raise ValueError(f"fused=True: the plan's topk {plan.topk} is not the worker's {worker.topk}")

    def covers(self, worker, batch, batch_result):
        from sglang.srt.speculative import eagle_worker_v2 as ew2
        from sglang.srt.runtime_context import get_spec

        if get_spec().speculative_use_rejection_sampling or getattr(ew2, "_is_hip", False):
            return False
        if worker.seed_dsa_topk_from_draft_extend or worker.draft_runner.canary_manager is not None:
            return False
        bs = batch.seq_lens.numel()
        if bs == 0 or bs > self.slot._max_bs or not self.runner.can_run(bs):
            return False
        hidden = batch_result.logits_output.hidden_states
        if hidden is None or hidden.dtype != self.runner._act or hidden.shape[-1] != self.slot._hin:
            return False
        if hidden.shape[0] != bs * self.slot._n:
            return False
        cpu = getattr(batch, "seq_lens_cpu", None)
        if cpu is not None and int(cpu.max()) + self.slot._n > self.slot._ctx:
            return False
        return True


def install(target, plan, *, fused=False, gemms="cached", adaptive=True, decode=True, allow_other_versions=False,
            l2_prefetch="off"):
    """Installs specplan into a started SGLang EAGLE worker (after the scheduler's
    `init_model_worker`, which captures SGLang's graphs and resets the slot first). Returns
    the draft-extend slot runner; `runner.tiers` lists the adaptive tiers (num_steps) it was
    set on, `runner.decode` the draft-decode slot runners by tier (the plan's
    `draft_decode_steps`; `decode=False` leaves SGLang's)."""
    version = _sglang_version()
    if version is not None and version != SGLANG_VERSION and not allow_other_versions:
        raise RuntimeError(
            f"specplan.sglang is built and tested against SGLang {SGLANG_VERSION}; this is {version} "
            "(pass allow_other_versions=True to try anyway)"
        )
    eagle, dw = _find_draft_worker(target)
    n = getattr(dw, "speculative_num_draft_tokens", plan.num_draft_tokens)
    if n != plan.num_draft_tokens:
        raise ValueError(f"plan: num_draft_tokens {plan.num_draft_tokens}, the worker runs {n}")
    if getattr(dw, "topk", plan.topk) != plan.topk:
        raise ValueError(f"plan: topk {plan.topk}, the worker runs {dw.topk}")
    slot = SGLangDraftExtendRunner.from_draft_worker(dw, plan, gemms=gemms, l2_prefetch=l2_prefetch)
    dw.cuda_graph_runner_for_draft_extend = slot
    slot.tiers = []
    ac = getattr(eagle, "adaptive_controller", None) if eagle is not None else None
    if ac is not None:
        if not adaptive:
            raise ValueError("the worker runs adaptive speculation (adaptive=False refuses it)")
        for steps, st in getattr(ac, "_states", {}).items():
            if getattr(st, "speculative_num_draft_tokens", None) == plan.num_draft_tokens:
                st.cuda_graph_runner_for_draft_extend = slot
                slot.tiers.append(steps)
        logger.info("specplan: draft-extend installed on adaptive tiers %s (others keep SGLang's)", slot.tiers)
    slot.decode = _install_decode(dw, ac, slot, decode)
    if fused:
        original = dw._draft_extend_for_decode
        dw._specplan_fused = _Fused(dw, slot, original)
        dw._draft_extend_for_decode = types.MethodType(_fused_draft_extend, dw)
    return slot
