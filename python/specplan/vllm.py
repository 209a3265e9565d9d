"""specplan in vLLM 0.33.0's Model Runner V2 (the default runner) as an EAGLE speculator.

`SpecplanEagleSpeculator` is vLLM's own `EagleSpeculator` (`TargetDependentARSpeculator`)
whose first draft pass — `_prefill`, the draft model over the verified tokens, K/V written at
the target's slots, one draft token sampled per request — is specplan's draft-extend plan: one
CUDA graph per batch size on vLLM's KV cache, block table and draft weights in place. With a
draft-decode phase in the plan (`draft_decode_steps=K`, or tiers for vLLM's dynamic K'), the
later chain steps (vLLM's `_multi_step_decode` / `_fused_multi_step_decode`: K' − 1 forwards
of one row per request) are the plan's too (one graph per batch size on the same memory). Every batch the plan does not serve runs
vLLM's own `_prefill`: chunked prefills (a query that is not K+1 tokens),
dummy and profile runs, probabilistic draft sampling, multimodal inputs, data or context
parallelism, a batch size without a graph, or contexts past the plan's.

What it reads from vLLM, all in place:
- K/V: each draft attention layer's `kv_cache` (`static_forward_context[name]`), logical
  `[blocks, kv_heads, block, 2·D]` with K in `[..., :D]` and V in `[..., D:]`, in whatever
  physical order vLLM's `KVCacheLayout` gave it (the strides are registered as they are);
- the persistent block table of the draft layers' KV cache group (`block_tables.
  block_tables[g].gpu`, int32, indexed by request-state row through `idx_mapping`; manager
  block size);
- the inputs vLLM's `prepare_prefill_inputs` leaves: the shifted int32 ids, `seq_lens`,
  `last_token_indices` (each request's selected row, so the accept length is implied);
- EAGLE-3: the target's auxiliary hidden states `cat(aux)` [T, 3·H_t], taken before vLLM's
  `combine_hidden_states` so the fc runs once, inside the plan (`combine_hidden_states` is
  wrapped on the draft model: on a step specplan serves it returns its buffer unchanged);
  `model.layers.0.*`, `model.fc.weight`, `draft_id_to_target_id` (the plan's `d2t`: the
  sampled ids are target ids, as vLLM's `compute_logits` makes them);
- EAGLE-1: the target's last hidden state [T, H]; fc inside the plan as vLLM's forward has it.

It leaves what vLLM's `_prefill` leaves: `draft_tokens[:R, 0]`, `hidden_states[:R]` (the
selected rows before the final norm), `input_buffers.positions[:R]`, `sample_src_positions`.

Install it before the model runner is built (MRv2 calls `init_speculator` in
`GPUModelRunner.__init__`), in every worker process — e.g. from a `vllm.general_plugins`
entry point:

    import specplan, specplan.vllm
    plan = specplan.Plan.compile(hf_config="eagle3/config.json", speculative_eagle_topk=1,
                                 speculative_num_steps=3, speculative_num_draft_tokens=4,
                                 page_size=16, max_context_len=8192)
    specplan.vllm.install(plan)    # rebinds vLLM's EagleSpeculator to the subclass
"""

import logging

from ._runner import Engine

VLLM_VERSION = "0.33.0"

logger = logging.getLogger("vllm.specplan")

_STATE = {"plan": None, "gemms": "cached", "l2_prefetch": "off", "original": None}


def _base():
    from vllm.v1.worker.gpu.spec_decode.eagle import speculator as mod

    return mod, _STATE["original"] or mod.EagleSpeculator


def _layer_index(name):
    """`model.layers.{i}.self_attn.attn` → i."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return 0


def make_speculator_class(base):
    """The subclass of vLLM's `EagleSpeculator` (`base`) whose first draft pass is the plan."""

    class SpecplanEagleSpeculator(base):
        specplan_plan = None

        # ---- lifecycle (vLLM's order: __init__, load_model, set_attn, init_cudagraph_manager,
        # init_kv_cache, capture, propose per step) ----

        def load_model(self, target_model):
            super().load_model(target_model)
            self._sp_runner = None
            self._sp_take = self._sp_take_decode = self._sp_decoded = False
            self._sp_cat = None
            plan = self.specplan_plan or _STATE["plan"]
            self._sp_plan = plan
            self._sp_tiers = set()
            if plan is None:
                return
            self._sp_tiers = {int(label.split(":")[1]) for label, _, _ in plan.phases()
                              if label.startswith("draft_decode:")}
            if self._sp_tiers and "verify_tokens" in {s[0] for s in plan.signature(1, f"draft_decode:{min(self._sp_tiers)}")}:
                raise ValueError("specplan plan: draft_decode_outputs has verify, which needs tree roots vLLM's chain "
                                 "does not have; compile it with draft_decode_outputs=\"tree\"")
            if plan.num_draft_tokens != self.num_speculative_steps + 1 or plan.topk != 1:
                raise ValueError(
                    f"specplan plan: num_draft_tokens {plan.num_draft_tokens}, topk {plan.topk}; vLLM's chain of "
                    f"{self.num_speculative_steps} drafts needs num_draft_tokens {self.num_speculative_steps + 1}, topk 1"
                )
            if "topk" not in plan.outputs.split(","):
                # The first draft is the plan's top-1 in the target's vocabulary ("topk"):
                # "topk-draft" leaves EAGLE-3 ids in the draft vocabulary (d2t not applied),
                # and a logits-only plan emits no ids at all.
                raise ValueError(
                    f"specplan plan: outputs {plan.outputs!r}; vLLM's speculator needs the plan's top-1 in the "
                    "target's vocabulary (compile with outputs=\"topk\")"
                )
            eagle3 = self.method == "eagle3"
            if (plan.head == "eagle3") != eagle3:
                raise ValueError(f"specplan plan: an {plan.head} head, vLLM's method is {self.method}")
            if eagle3:
                model = self.model
                for name in ("input_norm", "fc_norm"):
                    if getattr(model.model, name, None) is not None:
                        raise ValueError(f"draft model: {name} before fc is not supported by specplan")
                original = model.combine_hidden_states
                spec = self

                def combine_hidden_states(x):
                    # On a step specplan serves, the plan applies the fc itself (one GEMM, not
                    # two): keep the raw cat(aux) and return the buffer propose copies into.
                    if spec._sp_take:
                        spec._sp_cat = x
                        return spec.hidden_states[: x.shape[0]]
                    return original(x)

                model.combine_hidden_states = combine_hidden_states

        def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups):
            super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups)
            self._sp_kv_config = kv_cache_config

        def init_cudagraph_manager(self, cudagraph_mode):
            super().init_cudagraph_manager(cudagraph_mode)
            if self._sp_plan is None:
                return
            # specplan's graph replaces vLLM's prefill graph: vLLM runs `_prefill` eagerly (ours
            # replays the plan's graph; the steps it leaves to vLLM run its own prefill).
            from vllm.config.compilation import CUDAGraphMode
            from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
                SpeculatorCudaGraphManager,
            )

            self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(
                self.vllm_config, self.device, CUDAGraphMode.NONE, self.num_speculative_steps + 1
            )

        def capture(self):
            if self._sp_plan is not None and self._sp_runner is None:
                self._sp_build()
            super().capture()

        # ---- registration ----

        def _sp_build(self):
            """Registers vLLM's draft KV tensors, block table and draft weights with the plan
            (once the KV cache is bound)."""
            plan = self._sp_plan
            sfc = self.vllm_config.compilation_config.static_forward_context
            names = sorted(self.draft_attn_layer_names, key=_layer_index)
            if len(names) != plan.num_layers:
                raise ValueError(f"vLLM's draft has {len(names)} attention layers, the plan {plan.num_layers}")
            kv = [sfc[n].kv_cache for n in names]
            if any(t is None or (hasattr(t, "numel") and t.numel() == 0) for t in kv):
                raise RuntimeError("vLLM's draft KV cache is not bound yet (build after init_kv_cache)")
            group = None
            for g, grp in enumerate(self._sp_kv_config.kv_cache_groups):
                if names[0] in grp.layer_names:
                    group = g
            if group is None:
                raise ValueError(f"no KV cache group holds {names[0]}")
            table = self.block_tables.block_tables[group].gpu
            block = self.block_tables.block_sizes[group]
            engine = Engine(
                plan, _weights(self.model, plan), kv_cache=kv, kv_layout="BHNC", block_table=table,
                block_size=block, gemms=_STATE["gemms"], tp_group=_vllm_tp(plan, self),
                l2_prefetch=_STATE["l2_prefetch"],
            )
            runner = engine.draft_extend()
            self._sp_runner = runner
            self._sp_buckets = set(plan.graph_buckets)
            self._sp_max_bs = max(self._sp_buckets) if self._sp_buckets else 0

        # ---- per step ----

        def _sp_covers(self, input_batch, dummy_run, is_profile, mm_inputs, dp_sync_state):
            if self._sp_plan is None or dummy_run or is_profile or mm_inputs is not None:
                return False
            if dp_sync_state is not None or self.dp_size != 1 or self.pcp_manager is not None:
                return False
            if self.draft_logits is not None or getattr(self, "acceptance_estimator", None) is not None:
                return False
            if getattr(self, "draft_watermarker", None) is not None:
                return False
            r = input_batch.num_reqs
            n = self._sp_plan.num_draft_tokens
            if r == 0 or r > self._sp_plan.max_requests or input_batch.num_tokens != r * n:
                return False
            if not bool((input_batch.num_scheduled_tokens[:r] == n).all()):
                return False
            if int(input_batch.seq_lens_cpu_upper_bound[:r].max()) > self._sp_plan.max_context_len:
                return False
            if self._sp_runner is None:
                self._sp_build()
            return self._sp_runner.can_run(r)

        def _sp_decode_covers(self, input_batch, dummy_run, is_profile, mm_inputs, dp_sync_state):
            """Whether the plan's draft-decode phase serves this step's chain (steps 1..K'−1):
            a tier for K' is picked in `_sp_decode`; greedy drafts, no dummy or profile run,
            no DP/PCP, no multimodal inputs, and every request's chain within the plan's
            context."""
            if self._sp_plan is None or not self._sp_tiers or dummy_run or is_profile or mm_inputs is not None:
                return False
            if dp_sync_state is not None or self.dp_size != 1 or self.pcp_manager is not None:
                return False
            if self.draft_logits is not None or getattr(self, "acceptance_estimator", None) is not None:
                return False
            if getattr(self, "draft_watermarker", None) is not None or not self.advance_draft_positions:
                return False
            r = input_batch.num_reqs
            if r == 0 or r > self._sp_plan.max_requests:
                return False
            # The chain reaches position seq_len − 1 + K' − 1 at most (seq_lens count the K
            # drafts verified, so this bounds it from above).
            if int(input_batch.seq_lens_cpu_upper_bound[:r].max()) + self.num_speculative_steps > self._sp_plan.max_context_len:
                return False
            if self._sp_runner is None:
                self._sp_build()
            return True

        def _sp_decode(self, num_reqs, skip_attn, num_speculative_steps):
            """vLLM's chain steps 1..K'−1 as the plan's draft-decode tier K' (one phase: the
            K' − 1 forwards, K/V at positions L .. L+K'−2 through the block table, greedy ids
            in the target vocabulary): the first draft, the hidden rows and positions the
            first pass left are its inputs, `draft_tokens[:R, :K']` its output. False: vLLM's
            loop runs."""
            if not self._sp_take_decode or skip_attn or num_speculative_steps not in self._sp_tiers:
                return False
            import torch

            r = num_reqs
            runner = self._sp_runner.engine.draft_decode(num_speculative_steps)
            if not runner.can_run(r):
                return False
            # The chain's root probability, 1 (vLLM's greedy first draft): one buffer for
            # every step, not an allocation and a fill per step.
            ones = getattr(self, "_sp_ones", None)
            if ones is None or ones.shape[0] < r or ones.device != self.draft_tokens.device:
                ones = torch.ones((self._sp_plan.max_requests, 1), dtype=torch.float32, device=self.draft_tokens.device)
                self._sp_ones = ones
            out = runner.run(
                ones[:r],
                self.draft_tokens[:r, :1].contiguous(),
                self.hidden_states[:r],
                self.idx_mapping[:r],
                # prepare_decode_inputs advanced them: each request's committed length L,
                # the chain's first position.
                self.input_buffers.positions[:r],
            )
            if runner.device.type == "cpu":
                e = runner.last_error()
                if e is not None:
                    logger.error("specplan draft decode: %s", e)
            # On CUDA nothing waits here: the refusal ring holds both phases' steps and the
            # next step's poll (no wait, no copy) logs them.
            self.draft_tokens[:r, :num_speculative_steps] = out.draft_tokens
            self._sp_decoded = True
            return True

        def _multi_step_decode(self, num_reqs, skip_attn, batch_desc, num_tokens_across_dp,
                               seq_lens_cpu_upper_bound, num_speculative_steps):
            if self._sp_decode(num_reqs, skip_attn, num_speculative_steps):
                return None
            return super()._multi_step_decode(num_reqs, skip_attn, batch_desc, num_tokens_across_dp,
                                              seq_lens_cpu_upper_bound, num_speculative_steps)

        def _fused_multi_step_decode(self, num_reqs, skip_attn, batch_desc, num_tokens_across_dp,
                                     seq_lens_cpu_upper_bound, num_speculative_steps):
            if self._sp_decode(num_reqs, skip_attn, num_speculative_steps):
                return None
            return super()._fused_multi_step_decode(num_reqs, skip_attn, batch_desc, num_tokens_across_dp,
                                                    seq_lens_cpu_upper_bound, num_speculative_steps)

        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                    num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                    dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                    is_profile=False, num_speculative_tokens=None):
            self._sp_take = self._sp_covers(input_batch, dummy_run, is_profile, mm_inputs, dp_sync_state)
            self._sp_take_decode = self._sp_decode_covers(input_batch, dummy_run, is_profile, mm_inputs,
                                                          dp_sync_state)
            self._sp_decoded = False
            self._sp_reqs = input_batch.num_reqs
            try:
                return super().propose(
                    input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                    num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
                    dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
                    is_profile=is_profile, num_speculative_tokens=num_speculative_tokens,
                )
            finally:
                self._sp_take = self._sp_take_decode = False
                self._sp_cat = None

        def _prefill(self, num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp,
                     cudagraph_runtime_mode=None, mm_inputs=None, skip_sample=False):
            if not self._sp_take or skip_sample:
                return self._sp_vllm_prefill(num_reqs, num_tokens, attn_metadata, slot_mappings,
                                             num_tokens_across_dp, cudagraph_runtime_mode, mm_inputs, skip_sample)
            r = num_reqs
            t = r * self._sp_plan.num_draft_tokens
            lti = self.last_token_indices[:r]
            positions = self.input_buffers.positions[lti]
            hidden_in = self._sp_cat[:t] if self.method == "eagle3" else self.hidden_states[:t]
            out = self._sp_runner.run(
                self.input_buffers.input_ids[:t],
                hidden_in,
                self.idx_mapping[:r],
                self.input_buffers.seq_lens[:r],
                lti,
                prefix_includes_new_tokens=True,
                accept_is_select_index=True,
                out={"hidden_states": self.hidden_states[:r]},
            )
            self.draft_tokens[:r, 0] = out.topk_index[:, 0]
            self.input_buffers.positions[:r] = positions
            self.sample_src_positions[:r] = positions + 1

        def _sp_vllm_prefill(self, num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp,
                             cudagraph_runtime_mode, mm_inputs, skip_sample):
            kw = {"mm_inputs": mm_inputs, "skip_sample": skip_sample}
            if cudagraph_runtime_mode is not None:
                kw["cudagraph_runtime_mode"] = cudagraph_runtime_mode
            return super()._prefill(num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, **kw)

        def specplan_report(self):
            """DeviceErrors of the steps finished since the last report (no wait), logged."""
            if self._sp_runner is None:
                return []
            errors, _ = self._sp_runner.poll_error()
            for e in errors:
                logger.error("specplan draft prefill: %s", e)
            return errors

    SpecplanEagleSpeculator.__qualname__ = "SpecplanEagleSpeculator"
    return SpecplanEagleSpeculator


def _vllm_tp(plan, speculator):
    """vLLM 0.33.0 runs the draft with the target's tensor parallelism, or with 1
    (`draft_tensor_parallel_size`, config/speculative.py:427, 1851-1869: the whole head on
    every rank): a sharded plan of this rank and its NCCL group (vllm.distributed's
    get_tp_group()), or an unsharded plan and none."""
    from ._runner import _engine_tp

    cfg = getattr(getattr(speculator, "speculative_config", None), "draft_parallel_config", None)
    draft_tp = getattr(cfg, "tensor_parallel_size", None)
    try:
        from vllm.distributed import parallel_state as ps

        size = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        if draft_tp is not None:
            size = min(size, int(draft_tp))
        rank = ps.get_tensor_model_parallel_rank() if size > 1 else 0
    except ImportError:
        size, rank = 1, 0
    return _engine_tp(plan, "vLLM", size, rank, lambda: ps.get_tp_group())


def _weights(model, plan):
    """vLLM's draft module's tensors under the plan's names, in place."""
    import torch

    eagle3 = plan.head == "eagle3"
    out = {}
    for name, p in model.named_parameters():
        n = name[len("model."):] if name.startswith("model.") else name
        if eagle3 and n.startswith("layers.0."):
            n = "midlayer." + n[len("layers.0."):]
        out[n] = p.data
    for name, b in model.named_buffers():
        if name.endswith("draft_id_to_target_id"):
            out["d2t"] = b
    inner = model.model
    out["embed_tokens.weight"] = inner.embed_tokens.weight.data
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        out["lm_head.weight"] = head.weight.data
    names = {w[0] for w in plan.weights()}
    if "d2t" in names and "d2t" not in out:
        p = getattr(model, "draft_id_to_target_id", None)
        if p is None:
            raise ValueError("draft model: the plan maps ids (d2t) but the draft has no draft_id_to_target_id")
        out["d2t"] = p.data if hasattr(p, "data") else p
    if "d2t" in out:
        out["d2t"] = out["d2t"].to(torch.int64).contiguous()
    if "fc.bias" in out and not plan.fc_bias:
        raise ValueError("draft model: it has fc.bias, the plan has none")
    if plan.fc_bias and "fc.bias" not in out:
        raise ValueError("draft model: vLLM's fc has no bias, the plan has one (compile with bias = false)")
    for n in list(out):
        if n.endswith(".bias") and "self_attn" in n:
            raise ValueError(f"draft model: {n}: attention biases are not supported")
    return out


def install(plan, *, gemms="cached", allow_other_versions=False, l2_prefetch="off"):
    """Makes vLLM build `SpecplanEagleSpeculator` for EAGLE / EAGLE-3 (rebinding the name
    MRv2's `init_speculator` reads). Call it in every worker process before the model runner
    is built. Returns the class."""
    import vllm

    version = getattr(vllm, "__version__", None)
    if version != VLLM_VERSION and not allow_other_versions:
        raise RuntimeError(
            f"specplan.vllm is built and tested against vLLM {VLLM_VERSION}; this is {version} "
            "(pass allow_other_versions=True to try anyway)"
        )
    mod, base = _base()
    if _STATE["original"] is None:
        _STATE["original"] = base
    cls = make_speculator_class(_STATE["original"])
    _STATE["plan"], _STATE["gemms"], _STATE["l2_prefetch"] = plan, gemms, l2_prefetch
    mod.EagleSpeculator = cls
    return cls


def uninstall():
    """Restores vLLM's own EagleSpeculator."""
    if _STATE["original"] is not None:
        mod, _ = _base()
        mod.EagleSpeculator = _STATE["original"]
    _STATE["plan"] = None
