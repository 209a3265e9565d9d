"""SGLang adapter: a draft-extend runner with SGLang's contract (`can_run_graph(forward_batch)`,
`execute(forward_batch)`), reading a `ForwardBatch`'s fields:

    input_ids             int64 [bs*N]
    req_pool_indices      int64 [bs]     rows of req_to_token
    seq_lens              int64 [bs]     prefix + N (SGLang counts the N new tokens)
    seq_lens_cpu          optional host copy (checked on the host first when present)
    spec_info.hidden_states   [bs*N, H]  the target's hidden states
    spec_info.accept_length   int32 [bs] accepted tokens (some versions store A − 1: pass
                              accept_length_offset=1)

Plugging it into SGLang (EAGLE worker v2): after the worker has started, build a runner on the
draft model's own pools and weights and put it where the worker looks for its draft-extend
CUDA-graph runner:

    from specplan.sglang import SGLangDraftExtendRunner
    worker = ...  # the EAGLE draft worker (EagleDraftWorker / its draft_worker)
    worker.cuda_graph_runner_for_draft_extend = SGLangDraftExtendRunner.from_worker(worker, plan)

`_draft_extend_for_decode` then calls `can_run_graph` / `execute` instead of the hand-captured
graph; batches the plan cannot serve fall back to SGLang's own forward as before. The names above
move between SGLang versions: `from_worker` reads them in one place (`_worker_parts`).
"""

from ._runner import DraftExtendRunner


class SGLangDraftExtendRunner:
    """Wraps a DraftExtendRunner registered on SGLang's memory (`req_to_token` token slots,
    per-layer token pools)."""

    def __init__(self, runner, accept_length_offset=0):
        if not isinstance(runner, DraftExtendRunner):
            raise TypeError(f"runner: expected a specplan.DraftExtendRunner, got {type(runner).__name__}")
        if accept_length_offset not in (0, 1):
            raise ValueError("accept_length_offset: 0 (spec_info stores A) or 1 (it stores A - 1)")
        self.runner = runner
        self.accept_length_offset = accept_length_offset
        self._plus_one = None

    @staticmethod
    def _batch_size(forward_batch):
        bs = getattr(forward_batch, "batch_size", None)
        if bs is None:
            bs = forward_batch.req_pool_indices.shape[0]
        return int(bs)

    def can_run_graph(self, forward_batch):
        return self.runner.can_run(self._batch_size(forward_batch))

    # Older SGLang names.
    def can_run(self, forward_batch):
        return self.can_run_graph(forward_batch)

    def _accept(self, spec):
        accept = getattr(spec, "accept_length", None)
        if accept is None:
            accept = getattr(spec, "accept_lens", None)
        if accept is None:
            raise AttributeError("forward_batch.spec_info has neither accept_length nor accept_lens")
        if self.accept_length_offset:
            # A - 1 stored: add one on the stream (a small kernel; no host round trip).
            accept = accept + 1
        return accept

    def execute(self, forward_batch):
        """Runs the draft-extend step; returns an object with `topk_p`, `topk_index` and
        `hidden_states` (views valid until the next call)."""
        spec = forward_batch.spec_info
        return self.runner.run(
            forward_batch.input_ids,
            spec.hidden_states,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self._accept(spec),
            prefix_lens_cpu=getattr(forward_batch, "seq_lens_cpu", None),
            prefix_includes_new_tokens=True,
        )

    def replay(self, forward_batch, *args, **kwargs):
        return self.execute(forward_batch)

    @classmethod
    def from_worker(cls, worker, plan, accept_length_offset=0, gemms="cached"):
        """Builds the runner on a started SGLang EAGLE draft worker's memory: the draft model
        runner's token pools (`token_to_kv_pool.get_kv_buffer(layer)`), the shared
        `req_to_token_pool.req_to_token` and the draft model's parameters (SGLang's names,
        e.g. `model.layers.0.self_attn.qkv_proj.weight`, already fused as the plan packs them)."""
        pools, table, params = _worker_parts(worker, plan.num_layers)
        ks = [k for k, _ in pools]
        vs = [v for _, v in pools]
        runner = DraftExtendRunner(plan, params, ks, vs, req_to_token=table, gemms=gemms)
        return cls(runner, accept_length_offset=accept_length_offset)


def _worker_parts(worker, layers):
    """(per-layer (K, V), req_to_token, {name: parameter}) of an SGLang draft worker."""
    mr = getattr(worker, "draft_model_runner", None) or getattr(worker, "model_runner", None)
    if mr is None:
        raise AttributeError("the worker has neither draft_model_runner nor model_runner")
    pool = mr.token_to_kv_pool
    start = getattr(pool, "start_layer", 0) or 0
    pools = [pool.get_kv_buffer(start + layer) for layer in range(layers)]
    table = mr.req_to_token_pool.req_to_token
    params = dict(mr.model.named_parameters())
    return pools, table, params
