"""specplan.vllm against vLLM 0.33.0's own code: `specplan.vllm.install(plan)` makes vLLM's
`init_speculator` build `SpecplanEagleSpeculator`; vLLM's `load_model` loads the release's
`Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM` from a safetensors checkpoint (random
weights) and shares the target's embedding / lm_head; the real `set_attn` (TRITON_ATTN
builders), `BlockTables` and `init_kv_cache` bind the KV cache in the layout under test. The
release's `propose` then runs a verify step's batch twice from the same state: once with
specplan serving the first draft pass (`_prefill`), once with vLLM's own `_prefill` (the draft
model's real forward). The drafts `[R, K]` (the later K-1 from vLLM's fused decode loop, fed
by what the first pass left), the state the first pass leaves, and the K/V it writes are
compared, and specplan's first pass with specplan's own runner on the same tensors.

Runs where the pinned release is installed (`.ci/engines`); elsewhere every test is reported
as skipped. CPU tensors: specplan's CPU executor in place on vLLM's memory, vLLM's kernels in
triton's interpreter (vllm_env says what it sets and every attribute it replaces).
"""

import os
import types

import pytest

import vllm_env as env  # sets the environment vLLM reads when imported (imports no vLLM)

vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed here (.ci/engines installs it)")
if not env.REAL_VLLM:  # cuda_stubs' stand-in `vllm` (SGLang's venv) is not the release
    pytest.skip("vLLM 0.33.0 is not installed here (.ci/engines installs it)", allow_module_level=True)

import torch  # noqa: E402

import cuda_stubs  # noqa: E402
import specplan.vllm as sp_vllm  # noqa: E402

env.prepare()

K, N = env.K, env.N
# (request-state row, context before this step, query length, num_sampled): rows out of
# order (idx_mapping [5, 1, 6, 2, 0]), contexts of different lengths (29..32 crosses a block),
# accepted lengths 2, 4 (all), 1 (every draft rejected) and 3; request 3 is a new request's
# first prompt chunk of exactly K+1 tokens (num_sampled 0: vLLM's prefill computes for it what
# it computes for a decode that accepted all, so the plan serves it too). 5 requests: the
# plan runs its bucket of 8.
REQS = [(5, 29, N, 2), (1, 3, N, N), (6, 60, N, 1), (2, 0, N, 0), (0, 41, N, 3)]


def _valid(q, a):
    """Rows of a request the step keeps: the accepted ones, or all of a prefill chunk."""
    return a if a else q
PAD_TOKENS = 4  # the target's batch padded to 16 tokens (slot mapping PAD_SLOT_ID there)
LOGIT_TIE = 0.1  # a draft may differ only where vLLM's own logits are this close (bf16 hidden)

CASES = {
    "eagle3-LBNHC": dict(eagle3=True, layout="LBNHC"),  # NHD: vLLM's default
    "eagle3-LBHNC": dict(eagle3=True, layout="LBHNC"),  # HND
    "eagle3-BLHNC": dict(eagle3=True, layout="BLHNC"),  # block-outer: a block's pages of all layers together
    "eagle1-LBNHC": dict(eagle3=False, layout="LBNHC"),
    "eagle1-LBHNC": dict(eagle3=False, layout="LBHNC"),
    "eagle3-LBNHC-block32": dict(eagle3=True, layout="LBNHC", block=32),  # --block-size 32, a plan of page 32
}
_BUILT = {}


def built(name):
    """A bound case, its batch, and the two `propose` runs (specplan's first pass, vLLM's)."""
    if name not in _BUILT:
        case = env.Case(**CASES[name])
        case.bind()
        batch = env.Batch(case, REQS, pad_tokens=PAD_TOKENS)
        with env.spy_runner() as sp_calls:
            sp = env.propose(case, batch)
        with env.spy_runner() as vl_calls:
            vl = env.propose(case, batch, vllm_prefill=True)
        _BUILT[name] = types.SimpleNamespace(case=case, batch=batch, sp=sp, vl=vl, sp_calls=sp_calls,
                                             vl_calls=vl_calls)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def cmp(request):
    return built(request.param)


@pytest.fixture(scope="module", autouse=True)
def _uninstall_after():
    yield
    sp_vllm.uninstall()


def test_the_installed_release_is_0_33_0():
    assert vllm.__version__ == sp_vllm.VLLM_VERSION == "0.33.0"


def test_the_attention_stand_in_is_vllms_kernel():
    """The one vLLM kernel replaced (vllm_env.PATCHES): the attention calls of a propose by
    vLLM's own prefill and decode loop, replayed through vLLM's unified_attention kernel on
    float32 (triton's interpreter), give the stand-in's result: the draft prefill's (the
    target's metadata, K+1 query rows per request) and a decode step's (the fused loop's
    metadata, one row per request)."""
    c = built("eagle3-LBNHC").case
    batch = env.Batch(c, REQS[:2])
    with env.record_attention() as calls:
        env.propose(c, batch, vllm_prefill=True)
    assert len(calls) == K
    prefill, decode = calls[0], calls[1]
    assert prefill["q"].shape[0] == 2 * N and decode["q"].shape[0] == 2
    for call in (prefill, decode):
        got, mine = env.vllm_attention_kernel(call)
        assert torch.allclose(got, mine, atol=1e-5), (got - mine).abs().max()
        assert got.abs().max() > 0.1


def test_vllm_builds_specplans_speculator_with_its_real_draft_model(cmp):
    """install() rebinds the class vLLM's init_speculator reads: the speculator vLLM builds is
    SpecplanEagleSpeculator (a subclass of vLLM's EagleSpeculator); load_model loaded the
    release's draft class; the runner holds vLLM's draft K/V tensor, its persistent block
    table and the draft module's parameters in place, under vLLM's names."""
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle import speculator as eagle_mod

    c = cmp.case
    s = c.s
    assert type(s) is c.cls and c.cls.__name__ == "SpecplanEagleSpeculator"
    assert eagle_mod.EagleSpeculator.__name__ == "SpecplanEagleSpeculator"
    assert issubclass(c.cls, sp_vllm._STATE["original"]) and sp_vllm._STATE["original"].__name__ == "EagleSpeculator"
    assert type(s.model) is (Eagle3LlamaForCausalLM if c.eagle3 else EagleLlamaForCausalLM)
    assert s.draft_attn_layer_names == {env.DRAFT_LAYER}
    # vLLM's sharing (eagle/utils.py:45-119): EAGLE-3 takes the target's embedding and keeps
    # its own lm_head; EAGLE-1 keeps its own embedding and takes the target's lm_head.
    assert (s.model.model.embed_tokens is c.target.model.embed_tokens) == c.eagle3
    assert (s.model.lm_head is c.target.lm_head) == (not c.eagle3)
    runner = s._sp_runner
    assert runner is not None and runner.plan is c.plan
    kept_kv, table = runner.engine._pools_kept
    assert len(kept_kv) == 1 and kept_kv[0] is c.kv
    assert table is c.bt.block_tables[0].gpu and table.dtype == torch.int32
    params = dict(s.model.named_parameters())
    pre = "midlayer." if c.eagle3 else "layers.0."
    own = {
        "fc.weight": "model.fc.weight",
        "embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        pre + "self_attn.qkv_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
        pre + "mlp.gate_up_proj.weight": "model.layers.0.mlp.gate_up_proj.weight",
        pre + "self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    }
    if c.eagle3:
        own["d2t"] = "draft_id_to_target_id"
        own["norm.weight"] = "model.norm.weight"
    for plan_name, vllm_name in own.items():
        assert runner.engine._weights[plan_name].data_ptr() == params[vllm_name].data_ptr(), plan_name
    assert {w[0] for w in c.plan.weights()} <= set(runner.engine._weights)


def _same_drafts(sp, vl):
    """Drafts equal, except where vLLM's own logits make the two ids a near tie (bf16 hidden
    states differ in the last bits); a request's later drafts follow its first difference."""
    assert sp.drafts.shape == vl.drafts.shape
    differ = 0
    for r in range(sp.drafts.shape[0]):
        for j in range(sp.drafts.shape[1]):
            a, b = int(sp.drafts[r, j]), int(vl.drafts[r, j])
            if a == b:
                continue
            lv = vl.logits[j][r]
            assert lv[b] - lv[a] <= LOGIT_TIE, f"request {r} step {j}: {a} vs vLLM's {b}"
            if j > 0:
                ls = sp.logits[j - 1][r]
                assert ls[a] - ls[b] <= LOGIT_TIE, f"request {r} step {j}: {a} vs vLLM's {b}"
            differ += 1
            break
    return differ


def test_drafts_match_vllms_own_prefill(cmp):
    """The drafts propose returns, int64 [R, K] in the target's vocabulary, as the view of the
    persistent draft_tokens the model runner writes into: the first from specplan, the later
    ones from vLLM's fused decode loop fed by specplan's hidden states and positions; equal to
    the drafts of vLLM's own prefill."""
    sp, vl, c = cmp.sp, cmp.vl, cmp.case
    R = cmp.batch.R
    assert len(cmp.sp_calls) == 1 and len(cmp.vl_calls) == 0 and sp.prefills == vl.prefills == 1
    for run in (sp, vl):
        assert run.drafts.dtype == torch.int64 and tuple(run.drafts.shape) == (R, K)
        assert run.returned.data_ptr() == c.s.draft_tokens.data_ptr()
        assert bool(((run.drafts >= 0) & (run.drafts < env.V)).all())
    assert c.s.supports_decode_metadata_update  # TRITON_ATTN: the fused decode loop ran
    assert len(vl.logits) == K and len(sp.logits) == K - 1
    assert torch.equal(sp.drafts[:, 0], vl.drafts[:, 0])
    assert _same_drafts(sp, vl) <= 1, (sp.drafts, vl.drafts)
    assert c.s.specplan_report() == []
    assert not cuda_stubs.CALLS, f"a CUDA-only stub ran: {cuda_stubs.CALLS}"


def test_the_first_pass_leaves_what_vllms_prefill_leaves(cmp):
    """What the decode loop reads from the first pass: draft_tokens[:R, 0], hidden_states[:R]
    (the selected rows, EAGLE-3 before the final norm), positions[:R] and
    sample_src_positions[:R] (TDAR:476-490)."""
    a, b = cmp.sp.first, cmp.vl.first
    assert torch.equal(a["draft0"], b["draft0"])
    assert a["hidden"].dtype == b["hidden"].dtype == torch.bfloat16
    assert env.close(a["hidden"], b["hidden"], 1e-2)
    assert torch.equal(a["positions"], b["positions"]) and torch.equal(a["src"], b["src"])
    want = torch.tensor([c + _valid(q, a_) - 1 for (_, c, q, a_) in REQS])
    assert torch.equal(a["positions"], want) and torch.equal(a["src"], want + 1)


def test_the_first_pass_writes_vllms_kv_at_the_target_slots_and_nothing_else(cmp):
    """K/V of all R*(K+1) rows (the rejected rows too) at the target's slot mapping, as vLLM's
    prefill writes them; no other element of the KV buffer (target layers, other slots, the
    padded tokens' PAD slots) changes."""
    c, b = cmp.case, cmp.batch
    slots = b.slots
    assert slots.numel() == b.R * N and bool((slots >= 0).all())
    got, want, before = (c.slot_kv(run["kv"], slots) for run in (cmp.sp.first, cmp.vl.first, {"kv": c.kv0}))
    assert env.close(got, want, 1e-2), (got.float() - want.float()).abs().amax(dim=(1, 2))
    assert bool(((want.float() - before.float()).abs().amax(dim=(1, 2)) > 0).all())  # every row written
    assert c.unchanged_outside(cmp.sp.first["kv"], slots)
    assert c.unchanged_outside(cmp.vl.first["kv"], slots)


def test_the_first_pass_is_specplans_runner_on_the_same_tensors(cmp):
    """The adapter hands vLLM's buffers to the runner as they are (ids int32 [R*N], hidden
    [R*N, H_in], idx_mapping, the target's seq_lens, last_token_indices as selected rows), and
    its K/V and outputs are the runner's own, bit for bit."""
    c, b = cmp.case, cmp.batch
    (call,) = cmp.sp_calls
    ids, hidden, rows, seq_lens, select = call["args"]
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (b.R * N,)
    assert hidden.dtype == torch.bfloat16 and tuple(hidden.shape) == (b.R * N, c.plan.hidden_in_size)
    if c.eagle3:
        assert torch.equal(hidden, torch.cat(b.aux, -1)[: b.T])  # cat(aux): fc inside the plan
    else:
        assert torch.equal(hidden, b.last_hidden[: b.T])
    assert torch.equal(rows, b.idx_mapping) and torch.equal(seq_lens, b.seq_lens)
    assert torch.equal(select, torch.tensor([i * N + _valid(q, a) - 1 for i, (_, _, q, a) in enumerate(REQS)]))
    assert call["kwargs"]["prefix_includes_new_tokens"] is True and call["kwargs"]["accept_is_select_index"] is True
    c.restore()
    out = torch.empty(b.R, env.H, dtype=torch.bfloat16)
    own = c.s._sp_runner.run(ids, hidden, rows, seq_lens, select, prefix_includes_new_tokens=True,
                             accept_is_select_index=True, out={"hidden_states": out})
    assert torch.equal(c.flat.view(torch.int16), cmp.sp.first["kv"].view(torch.int16))
    assert torch.equal(out, cmp.sp.first["hidden"])
    assert torch.equal(own.topk_index[:, 0], cmp.sp.first["draft0"])
    # An output over the registered K/V pool is refused before anything runs (the pool and
    # the inputs unchanged). (One over the step's own inputs is what the adapter does: vLLM
    # writes the hidden rows over its input buffer.)
    run = c.s._sp_runner.run
    kv_before, hidden_before = c.flat.clone(), hidden.clone()
    at = (c.kv.data_ptr() - c.flat.data_ptr()) // c.flat.element_size()  # the pool's first element
    over_pool = c.flat[at: at + b.R * env.H].view(b.R, env.H)
    with pytest.raises(ValueError, match="outputs.hidden_states.*overlaps the registered k_cache"):
        run(ids, hidden, rows, seq_lens, select, prefix_includes_new_tokens=True, accept_is_select_index=True,
            out={"hidden_states": over_pool})
    assert torch.equal(c.flat.view(torch.int16), kv_before.view(torch.int16))
    assert torch.equal(hidden.view(torch.int16), hidden_before.view(torch.int16))


def test_eagle3_drafts_are_target_ids_mapped_once():
    """EAGLE-3: the plan maps the draft vocabulary through vLLM's draft_id_to_target_id (its
    offsets, registered in place) once: specplan's first drafts are the argmax of vLLM's
    compute_logits (lm_head, then the scatter to target ids), and every draft is a target id
    of the draft vocabulary."""
    cmp = built("eagle3-LBNHC")
    s = cmp.case.s
    d2t = s.model.draft_id_to_target_id
    assert cmp.case.s._sp_runner.engine._weights["d2t"].data_ptr() == d2t.data_ptr()
    targets = torch.arange(env.VD) + d2t
    assert bool((d2t != 0).any())
    assert bool(torch.isin(cmp.sp.drafts, targets).all())
    first = cmp.vl.logits[0]  # vLLM's own step-0 logits: -inf off the mapped ids
    assert bool(torch.isinf(first[:, torch.isin(torch.arange(env.V), targets, invert=True)]).all())
    assert torch.equal(first.argmax(-1), cmp.sp.first["draft0"])
    assert torch.equal(cmp.sp_calls[0]["topk_index"][:, 0], cmp.sp.drafts[:, 0])


def test_a_chunked_prefill_batch_runs_vllms_prefill():
    """A batch with a chunked-prefill row (6 prompt tokens, num_sampled 0) is not K+1 tokens
    per request: vLLM's own _prefill serves it and specplan's runner is not called."""
    c = built("eagle3-LBNHC").case
    batch = env.Batch(c, [(5, 29, N, 2), (2, 8, 6, 0), (6, 60, N, 1)])
    seen = []
    vllm_prefill = c.s._sp_vllm_prefill
    c.s._sp_vllm_prefill = lambda *a: seen.append(a[0]) or vllm_prefill(*a)
    try:
        with env.spy_runner() as calls:
            run = env.propose(c, batch)
    finally:
        del c.s._sp_vllm_prefill
    assert calls == [] and seen == [3] and run.prefills == 1
    assert tuple(run.drafts.shape) == (3, K) and len(run.logits) == K
    assert c.unchanged_outside(run.first["kv"], batch.slots)


def test_dummy_and_profile_runs_run_vllms_prefill():
    """GPUModelRunner's dummy runs (profile_run's, and the eager warm-up's) call propose with
    dummy_run=True and no attention metadata (MR:947-985), on a batch shaped like a uniform
    decode: vLLM's own _prefill serves them, specplan's runner is not called, no K/V is written."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.input_batch import InputBatch

    c = built("eagle3-LBNHC").case
    s = c.s
    g = torch.Generator().manual_seed(5)
    for is_profile in (True, False):
        c.restore()
        dummy = InputBatch.make_dummy(3, 3 * N, c.target_buffers)
        assert s._sp_covers(dummy, False, False, None, None)  # the shape alone would be served
        aux = [torch.randn(3 * N, env.H, generator=g).to(torch.bfloat16) for _ in range(3)]
        with env.spy_runner() as calls, set_current_vllm_config(c.vc):
            drafts = s.propose(
                dummy, None, None, aux[-1], aux, torch.ones(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                torch.zeros(env.MAX_REQS, 1, dtype=torch.int64), torch.zeros(1, env.MAX_REQS, dtype=torch.int32),
                torch.zeros(env.MAX_REQS), torch.zeros(env.MAX_REQS, dtype=torch.int64), dummy_run=True,
                skip_attn_for_dummy_run=True, is_profile=is_profile)
        assert calls == [] and tuple(drafts.shape) == (3, K)
        assert torch.equal(c.flat.view(torch.int16), c.kv0.view(torch.int16))
        assert not s._sp_take


def test_the_adapter_declines_what_the_plan_does_not_serve():
    """`_sp_covers` on vLLM's InputBatch: a uniform decode within the plan is served; more
    requests than the plan's, a context past its max_context_len, a non-uniform batch, dummy
    and profile runs, multimodal inputs, a DP sync, probabilistic drafting and context
    parallelism go to vLLM's own prefill."""
    c = built("eagle3-LBNHC").case
    s = c.s
    cover = lambda b, **kw: s._sp_covers(b.input_batch(), kw.get("dummy", False), kw.get("profile", False),  # noqa: E731
                                         kw.get("mm"), kw.get("dp"))
    uniform = env.Batch(c, REQS)
    assert cover(uniform)
    assert not cover(env.Batch(c, [(i % env.MAX_REQS, 4, N, 1) for i in range(9)]))  # 9 > max_requests 8
    assert not cover(env.Batch(c, [(0, env.CTX - N + 1, N, 1)]))  # seq_len CTX + 1
    assert cover(env.Batch(c, [(0, env.CTX - N, N, 1)]))  # seq_len CTX
    assert not cover(env.Batch(c, [(0, 4, N + 1, 1)]))  # K+2 tokens
    assert not cover(uniform, dummy=True) and not cover(uniform, profile=True)
    assert not cover(uniform, mm=([], torch.zeros(12, dtype=torch.bool)))
    assert not cover(uniform, dp=object())
    s.draft_logits = torch.zeros(env.MAX_REQS, K, env.V)
    try:
        assert not cover(uniform)
    finally:
        s.draft_logits = None
    s.pcp_manager = object()
    try:
        assert not cover(uniform)
    finally:
        s.pcp_manager = None
    assert cover(uniform)


def test_capture_builds_the_runner_and_keeps_vllms_prefill_eager():
    """init_cudagraph_manager gives the prefill a NONE manager (the plan's graphs replace
    vLLM's prefill graph); capture() registers vLLM's KV cache, block table and weights with
    the plan before any step and then runs vLLM's capture."""
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode

    c = env.Case(eagle3=False, layout="LBHNC", seed=4)
    c.bind()
    s = c.s
    assert s._sp_runner is None
    assert s.prefill_cudagraph_manager.cudagraph_mode == CUDAGraphMode.NONE
    s.idx_mapping.fill_(3)
    with set_current_vllm_config(c.vc):
        s.capture()
    assert s._sp_runner is not None and s._sp_buckets == {1, 2, 4, 8}
    assert [s._sp_runner.can_run(b) for b in (1, 3, 8, 9)] == [True, True, True, False]
    assert bool((s.idx_mapping == 0).all())  # vLLM's capture ran (TDAR:109-114)
    assert torch.equal(c.flat.view(torch.int16), c.kv0.view(torch.int16))


def test_a_plan_for_another_block_size_is_refused_when_registered():
    """vLLM's block size is known once the KV cache is bound: a plan compiled for page 16 on
    vLLM blocks of 32 is refused when capture() registers it (not run on the wrong pages)."""
    from vllm.config import set_current_vllm_config

    c = env.Case(eagle3=False, block=32, plan_flags=dict(page_size=16), seed=6)
    c.bind()
    with pytest.raises(ValueError, match="page_size"), set_current_vllm_config(c.vc):
        c.s.capture()


def test_plans_that_do_not_fit_vllms_speculator_are_refused():
    """load_model refuses a plan whose chain length differs from vLLM's num_speculative_tokens,
    and a plan for the other head."""
    c = env.Case(eagle3=True, plan_flags=dict(speculative_num_steps=2, speculative_num_draft_tokens=3), build=False)
    with pytest.raises(ValueError, match="num_draft_tokens 3"):
        c.build()
    c = env.Case(eagle3=True, build=False)
    _, eagle1_dir = env.write_model_dirs(c.tmp + "/e1", eagle3=False, seed=0)
    sp_vllm.install(env.compile_plan(eagle1_dir))
    with pytest.raises(ValueError, match="eagle1 head, vLLM's method is eagle3"):
        c.build()


@pytest.mark.parametrize("outputs", ["topk-draft", "logits"])
def test_plans_without_target_vocabulary_ids_are_refused(outputs):
    """vLLM's first draft is a target-vocabulary id: a "topk-draft" plan (EAGLE-3 ids left in
    the draft vocabulary) or a logits-only plan (no ids) is refused by load_model."""
    c = env.Case(eagle3=True, plan_flags=dict(outputs=outputs), build=False)
    with pytest.raises(ValueError, match="outputs"):
        c.build()


def test_the_readme_plugin_code():
    """The README's vLLM block, run as it is written (after vLLM's own speculator class is
    restored): the speculator vLLM then builds is specplan's, and its drafts are vLLM's own."""
    import readme_blocks
    from vllm.v1.worker.gpu.spec_decode.eagle import speculator as eagle_mod

    case = env.Case(eagle3=True, layout="LBNHC", plan=False, build=False)
    scope = {"draft_config": os.path.join(case.draft_dir, "config.json"), "max_model_len": env.CTX}
    exec(readme_blocks.block("test_vllm_0330.py::test_the_readme_plugin_code"), scope)
    case.plan, case.cls = scope["plan"], eagle_mod.EagleSpeculator
    assert case.cls.__name__ == "SpecplanEagleSpeculator"
    case.build()
    case.bind()
    batch = env.Batch(case, REQS, pad_tokens=PAD_TOKENS)
    with env.spy_runner() as calls:
        sp = env.propose(case, batch)
    assert calls, "specplan served the first pass"
    vl = env.propose(case, batch, vllm_prefill=True)
    _same_drafts(sp, vl)
