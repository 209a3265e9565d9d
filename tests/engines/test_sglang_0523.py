"""specplan.sglang against SGLang 0.5.23's own code: the release's
`EagleDraftWorker._draft_extend_for_decode` runs with specplan installed in its draft-extend
slot (the logits path) and with the fused path, on the release's `MHATokenToKVPool` (NHD and
HND, page sizes 1 and 16) and `ReqToTokenPool`, for EAGLE-1 and EAGLE-3 heads built by the
release's model classes on random weights. What lands in `next_draft_input` (`topk_p`,
`topk_index`, `hidden_states`) and the K/V written are compared with SGLang's own eager
draft-extend of the same step (its model forward, torch-native attention, logits
processor, top-k) and with specplan's own runner on the same tensors.

Runs where the pinned release is installed (`.ci/engines`); elsewhere every test is
reported as skipped. CPU tensors by default (the CPU executor in place on SGLang's
memory); SPECPLAN_ENGINES_DEVICE=cuda runs the same on the GPU (plans with kernels).
"""

import logging
import os

import pytest

sglang = pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed here (.ci/engines installs it)")

import sglang_env as env  # noqa: E402
import torch  # noqa: E402

import specplan  # noqa: E402
import specplan.sglang as sp_sglang  # noqa: E402

DEVICE = os.environ.get("SPECPLAN_ENGINES_DEVICE", "cpu")
CTX = 128


def test_the_installed_release_is_0_5_23():
    assert sglang.__version__ == sp_sglang.SGLANG_VERSION == "0.5.23"


class Case:
    """One configuration: a draft head, SGLang's pools, a worker, a plan for the same config."""

    def __init__(self, *, eagle3, topk, steps, ndraft, page_size=1, hnd=False, draft_vocab=None, outputs,
                 bias=None, host_lens=True, L=(5, 19, 3), accept=None, seed=0):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.eagle3, self.topk, self.n, self.page = eagle3, topk, ndraft, page_size
        env.publish_args(algo="EAGLE3" if eagle3 else "EAGLE", steps=steps, topk=topk, ndraft=ndraft,
                         page_size=page_size, device=DEVICE)
        # SGLang's EAGLE-1 fc always has a bias; the config says so for specplan's reader
        # (SGLang then also creates attention biases, left zero as a checkpoint without them).
        bias = (not eagle3) if bias is None else bias
        path = env.write_config(eagle3=eagle3, ctx=CTX, draft_vocab=draft_vocab, bias=bias)
        self.config_path = os.path.join(path, "config.json")
        self.mc = env.model_config(path, eagle3=eagle3)
        self.model = env.build_model(self.mc, eagle3=eagle3, device=DEVICE, seed=seed)
        cfg = self.mc.hf_config
        self.h = cfg.hidden_size
        self.h_in = 3 * self.h if eagle3 else self.h
        self.vocab = cfg.vocab_size
        self.r2t, self.kv = env.make_pools(max_reqs=16, ctx=CTX, kv_heads=cfg.num_key_value_heads,
                                          head_dim=cfg.head_dim, dtype=self.mc.dtype, page_size=page_size,
                                          hnd=hnd, device=DEVICE)
        algo = SpeculativeAlgorithm.EAGLE3 if eagle3 else SpeculativeAlgorithm.EAGLE
        self.dr = env.draft_runner(self.mc, self.r2t, self.kv, model=self.model, page_size=page_size, algo=algo,
                                   device=DEVICE)
        hot = getattr(self.model, "hot_token_id", None)
        if eagle3 and draft_vocab is not None:
            # What load_weights makes of a checkpoint's d2t: hot_token_id = d2t + arange(V_d).
            g = torch.Generator().manual_seed(seed + 1)
            hot = torch.randperm(self.vocab, generator=g)[:draft_vocab].sort().values.to(DEVICE)
        self.worker = env.draft_worker(self.dr, self.r2t, topk=topk, steps=steps, ndraft=ndraft, algo=algo,
                                       hot_token_id=hot, device=DEVICE)
        self.L = list(L)
        self.accept = list(accept) if accept else [1 + (i * 3) % ndraft for i in range(len(L))]
        self.host_lens = host_lens
        self.seed = seed
        self.plan = specplan.Plan.compile(
            hf_config=os.path.join(path, "config.json"), speculative_eagle_topk=topk, speculative_num_steps=steps,
            speculative_num_draft_tokens=ndraft, page_size=page_size, max_context_len=CTX, buckets=[1, 2, 4, 8],
            outputs=outputs, no_kernels=DEVICE == "cpu",
        )
        batch, _ = self.state()
        env.fill_prefix(self.kv, self.r2t, batch.req_pool_indices.tolist(), self.L)
        self.kv0 = [(k.clone(), v.clone()) for k, v in zip(self.kv.k_buffer, self.kv.v_buffer)]

    def state(self):
        return env.verify_state(L=self.L, N=self.n, accept=self.accept, vocab=self.vocab, h_in=self.h_in,
                                dtype=self.mc.dtype, r2t=self.r2t, mc=self.mc, seed=self.seed + 5,
                                host_lens=self.host_lens, device=DEVICE, page_size=self.page)

    def restore(self):
        for (k, v), (k0, v0) in zip(zip(self.kv.k_buffer, self.kv.v_buffer), self.kv0):
            k.copy_(k0)
            v.copy_(v0)

    def step(self, mutate=None):
        """The release's `_draft_extend_for_decode` on a fresh verify state (`mutate(batch)`
        edits it first): the `next_draft_input` it leaves and the K/V of the step's window."""
        self.restore()
        batch, result = self.state()
        if mutate is not None:
            mutate(batch)
        window = batch.out_cache_loc.clone()
        with torch.no_grad():
            self.worker._draft_extend_for_decode(batch, result)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        k, v = env.slot_kv(self.kv, window)
        return result.next_draft_input, (k.clone(), v.clone()), window


def close(a, b, tol):
    a, b = a.float().cpu(), b.float().cpu()
    return (a - b).abs().max().item() <= tol * (1.0 + b.abs().max().item())


def same_draft(got, want, *, logits_tol):
    """topk ids equal (a swap only between near-tied probabilities), probabilities and hidden
    states within bf16 tolerance."""
    gi, wi = got.topk_index.cpu(), want.topk_index.cpu()
    gp, wp = got.topk_p.cpu(), want.topk_p.cpu()
    assert gi.shape == wi.shape and gi.dtype == wi.dtype == torch.int64
    assert gp.shape == wp.shape and gp.dtype == wp.dtype == torch.float32
    for r in range(gi.shape[0]):
        for j in range(gi.shape[1]):
            if gi[r, j] != wi[r, j]:
                assert abs(gp[r, j] - wp[r, j]) <= logits_tol, f"request {r} slot {j}: id {gi[r, j]} vs {wi[r, j]}"
    assert close(gp, wp, 2e-2)
    assert got.hidden_states.shape == want.hidden_states.shape
    assert got.hidden_states.dtype == want.hidden_states.dtype
    assert close(got.hidden_states, want.hidden_states, 3e-2)


CASES = {
    "eagle1-topk1-nhd-page1": dict(eagle3=False, topk=1, steps=3, ndraft=4),
    "eagle1-topk4-n8-hnd-page4": dict(eagle3=False, topk=4, steps=3, ndraft=8, page_size=4, hnd=True),
    "eagle1-topk2-nhd-page16-no-host-lens": dict(eagle3=False, topk=2, steps=3, ndraft=6, page_size=16,
                                                 host_lens=False),
    "eagle3-topk1-d2t96-nhd-page1": dict(eagle3=True, topk=1, steps=3, ndraft=4, draft_vocab=96),
    "eagle3-topk4-fullvocab-hnd-page16": dict(eagle3=True, topk=4, steps=3, ndraft=8, page_size=16, hnd=True),
}


@pytest.fixture(params=sorted(CASES))
def cases(request):
    params = CASES[request.param]
    case = Case(outputs="topk-draft,logits", **params)
    # SGLang's torch-native attention reads pools as [slots, H, D]: its eager reference of an
    # HND case runs on an NHD twin (same seeds: same model, state and prefix K/V).
    ref = Case(outputs="logits", **{**params, "hnd": False}) if params.get("hnd") else case
    return case, ref


def test_logits_slot_and_fused_path_match_sglang_eager(cases):
    """SGLang's eager draft-extend (no runner in the slot), then specplan in the slot (the
    logits path: SGLang samples), then the fused path: the same drafts and K/V."""
    case, ref = cases
    want, (wk, wv), window = ref.step()
    slot = sp_sglang.install(case.worker, case.plan)
    assert case.worker.cuda_graph_runner_for_draft_extend is slot
    got, (gk, gv), _ = case.step()
    same_draft(got, want, logits_tol=2e-2)
    assert close(gk, wk, 3e-2) and close(gv, wv, 3e-2), "K/V of the step's window"
    # The slot's K/V and outputs equal specplan's own runner on the same tensors, bit for bit.
    case.restore()
    batch, result = case.state()
    own = slot.runner.run(result.next_token_ids.to(torch.int64), result.logits_output.hidden_states,
                          batch.req_pool_indices, batch.seq_lens, result.accept_lens)
    ok, ov = env.slot_kv(case.kv, window)
    assert torch.equal(ok, gk) and torch.equal(ov, gv)
    assert torch.equal(own.hidden_states, got.hidden_states)
    logits = own.logits
    if case.topk == 1:
        assert torch.equal(torch.argmax(logits, -1, keepdim=True), got.topk_index)
    # The fused path: specplan's own top-K, ids in the lm_head's vocabulary (SGLang maps
    # them later), topk_p = 1 for topk = 1.
    sp_sglang.install(case.worker, case.plan, fused=True)
    fused, (fk, fv), _ = case.step()
    same_draft(fused, got, logits_tol=1e-3)
    assert torch.equal(fk, gk) and torch.equal(fv, gv)
    assert torch.equal(fused.hidden_states, got.hidden_states)
    if case.topk == 1:
        assert torch.equal(fused.topk_p.cpu(), torch.ones(len(case.L), 1))
    assert fused.cuda_graph_compatible is True
    import cuda_stubs

    assert not cuda_stubs.CALLS, f"a CUDA-only stub ran: {cuda_stubs.CALLS}"


def test_the_slot_writes_only_the_window_and_returns_selected_rows():
    c = Case(outputs="logits", eagle3=False, topk=1, steps=3, ndraft=4)
    slot = sp_sglang.install(c.worker, c.plan)
    seen = {}
    execute = slot.execute

    def spy(fb, select_index):
        out = execute(fb, select_index)
        seen.update(out=out, select_index=select_index.clone(), bs=fb.seq_lens.numel())
        return out

    slot.execute = spy
    before = [(k.clone(), v.clone()) for k, v in c.kv0]
    _, _, window = c.step()
    out = seen["out"]
    assert out.next_token_logits.shape == (seen["bs"], c.plan.logits_size) and out.next_token_logits.dtype == torch.float32
    assert out.hidden_states.shape == (seen["bs"], c.h) and out.hidden_states.dtype == torch.bfloat16
    # Every K/V slot outside the window keeps its bits.
    k, v = c.kv.k_buffer[0], c.kv.v_buffer[0]
    mask = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
    mask[window.long().to(k.device)] = False
    assert torch.equal(k[mask], before[0][0][mask]) and torch.equal(v[mask], before[0][1][mask])
    assert c.dr.shared_read_done_event is None or DEVICE == "cuda"


def test_can_run_graph_follows_sglangs_gates():
    c = Case(outputs="logits", eagle3=False, topk=1, steps=3, ndraft=4, L=(3, 4, 5, 6, 7, 8, 9, 10, 11))
    slot = sp_sglang.install(c.worker, c.plan)
    calls = []
    can = slot.can_run_graph
    slot.can_run_graph = lambda fb: calls.append(fb.seq_lens.numel()) or can(fb)
    # 9 requests: above the largest bucket (8), so SGLang's eager path serves the step.
    c.L, c.accept = c.L, [1] * 9
    c.step()
    assert calls and all(b == 9 for b in calls)
    assert not can(_fb(c, width=c.n + 1))
    assert can(_fb(c, width=c.n, bs=3))
    slot._dp = True
    assert not can(_fb(c, width=c.n, bs=3))


def _fb(c, *, width, bs=None):
    import types

    bs = bs or len(c.L)
    return types.SimpleNamespace(
        spec_info=types.SimpleNamespace(num_tokens_per_req=width,
                                        hidden_states=torch.zeros(bs * c.n, c.h_in, dtype=torch.bfloat16)),
        seq_lens=torch.full((bs,), 10, dtype=torch.int64), seq_lens_cpu=None,
    )


def test_a_refused_request_is_logged_and_gets_an_empty_draft(caplog):
    c = Case(outputs="topk-draft,logits", eagle3=False, topk=2, steps=3, ndraft=4)
    sp_sglang.install(c.worker, c.plan, fused=True)
    good, (gk, gv), window = c.step()
    # Request 1's first new position names a slot past the pool: the device-side check
    # refuses it (it writes nothing) and the others are computed as before.
    def corrupt(batch):
        row, l = int(batch.req_pool_indices[1]), c.L[1]
        c.r2t.req_to_token[row, l] = c.kv.size + c.page * 4

    bad, (bk, bv), _ = c.step(corrupt)
    with caplog.at_level(logging.ERROR, logger="sglang.srt.speculative.specplan"):
        c.worker.cuda_graph_runner_for_draft_extend.report()
    assert any("; request 1:" in r.getMessage() for r in caplog.records), caplog.text
    assert torch.equal(bad.topk_index[1].cpu(), torch.zeros(2, dtype=torch.int64))
    assert torch.equal(bad.topk_p[1].cpu(), torch.zeros(2))
    assert bool((bad.hidden_states[1] == 0).all())
    for i in (0, 2):
        assert torch.equal(bad.topk_index[i], good.topk_index[i])
        assert torch.equal(bad.hidden_states[i], good.hidden_states[i])
    # Request 1 wrote no K/V (its window keeps the slots' earlier contents); the others did.
    n = c.n
    k0 = env.slot_kv_of(c.kv0[0][0], c.kv, window[n + 1:2 * n])
    assert torch.equal(bk[n + 1:2 * n], k0)
    assert torch.equal(bk[:n], gk[:n]) and torch.equal(bk[2 * n:], gk[2 * n:])


def test_a_request_reading_another_requests_new_slot_is_refused_naming_both(caplog):
    c = Case(outputs="topk-draft,logits", eagle3=False, topk=2, steps=3, ndraft=4)
    sp_sglang.install(c.worker, c.plan, fused=True)
    good, _, _ = c.step()
    # SGLang's req_to_token maps request 1's first cached position to the slot request 0's
    # first new token is written to in this step: their K/V would race.
    def alias(batch):
        r0, r1 = int(batch.req_pool_indices[0]), int(batch.req_pool_indices[1])
        c.r2t.req_to_token[r1, 0] = c.r2t.req_to_token[r0, c.L[0]]

    assert c.L[1] >= 1, "request 1 has a cached position to alias"
    bad, _, _ = c.step(alias)
    with caplog.at_level(logging.ERROR, logger="sglang.srt.speculative.specplan"):
        c.worker.cuda_graph_runner_for_draft_extend.report()
    assert any("request 1 (with request 0, which writes a slot it reads)" in r.getMessage()
               for r in caplog.records), caplog.text
    assert bool((bad.hidden_states[1] == 0).all())
    for i in (0, 2):
        assert torch.equal(bad.topk_index[i], good.topk_index[i])


def test_install_finds_the_worker_and_patches_matching_adaptive_tiers():
    import types

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    c = Case(outputs="logits", eagle3=False, topk=1, steps=3, ndraft=4)
    eagle = object.__new__(EAGLEWorkerV2)
    eagle._draft_worker = c.worker
    other = object()
    eagle.adaptive_controller = types.SimpleNamespace(_states={
        3: types.SimpleNamespace(speculative_num_draft_tokens=4, cuda_graph_runner_for_draft_extend=None),
        5: types.SimpleNamespace(speculative_num_draft_tokens=6, cuda_graph_runner_for_draft_extend=other),
    })
    sched = object.__new__(Scheduler)
    sched.draft_worker = eagle
    slot = sp_sglang.install(sched, c.plan)
    assert c.worker.cuda_graph_runner_for_draft_extend is slot
    assert eagle.adaptive_controller._states[3].cuda_graph_runner_for_draft_extend is slot
    assert eagle.adaptive_controller._states[5].cuda_graph_runner_for_draft_extend is other
    assert slot.tiers == [3]
    with pytest.raises(ValueError, match="adaptive"):
        sp_sglang.install(eagle, c.plan, adaptive=False)
    with pytest.raises(TypeError, match="EagleDraftWorker"):
        sp_sglang.install(object(), c.plan)


def test_mismatched_plans_and_modules_are_refused():
    c = Case(outputs="logits", eagle3=False, topk=1, steps=3, ndraft=4)
    other = specplan.Plan.compile(preset="tiny", outputs="logits", no_kernels=True)
    with pytest.raises(ValueError, match="num_draft_tokens|topk|num_layers|shape|draft model"):
        sp_sglang.install(c.worker, other)
    with pytest.raises(ValueError, match="topk-draft"):
        sp_sglang.install(c.worker, c.plan, fused=True)
    # A non-zero attention bias (a checkpoint that has one) is not what the plan computes.
    b = c.model.model.layers[0].self_attn.o_proj.bias
    if b is not None:
        b.data.fill_(0.5)
        with pytest.raises(ValueError, match="attention biases"):
            sp_sglang.install(c.worker, c.plan)


def test_the_readme_plugin_code():
    """The README's SGLang block, run as it is written, on a started worker (a Scheduler
    holding an EAGLEWorkerV2): the fused path it installs gives SGLang's eager drafts."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    import readme_blocks

    c = Case(outputs="topk-draft,logits", eagle3=False, topk=1, steps=3, ndraft=4)
    want, (wk, wv), _ = c.step()
    eagle = object.__new__(EAGLEWorkerV2)
    eagle._draft_worker = c.worker
    eagle.adaptive_controller = None
    scheduler = object.__new__(Scheduler)
    scheduler.draft_worker = eagle
    scope = {"draft_config": c.config_path, "max_context_len": CTX, "scheduler": scheduler}
    exec(readme_blocks.block("test_sglang_0523.py::test_the_readme_plugin_code"), scope)
    assert scope["plan"].outputs == "topk-draft,logits"
    assert hasattr(c.worker, "_specplan_fused")
    got, (gk, gv), _ = c.step()
    same_draft(got, want, logits_tol=2e-2)
    assert close(gk, wk, 3e-2) and close(gv, wv, 3e-2)
