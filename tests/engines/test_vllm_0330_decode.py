"""specplan's draft-decode phase as vLLM 0.33.0's chain steps: with `draft_decode_steps=K` in
the plan, the release's `propose` runs specplan's first pass (`_prefill`) and then, in place of
its decode loop (`_fused_multi_step_decode` on TRITON_ATTN), the plan's K − 1 chain forwards;
the reference is the same `propose` run entirely by vLLM (its prefill and its fused decode
loop: its draft model's forward, `compute_logits`, greedy sampling, `update_draft_inputs`).
The drafts `[R, K]` must be vLLM's but where vLLM's own logits show a near tie, each chain
step's K/V lands at the slot of position L + i through vLLM's block table within bf16
tolerance, and nothing else of the KV buffer changes. Same environment and stand-ins as
test_vllm_0330.py (vllm_env says what it sets and replaces).
"""

import types

import pytest

import vllm_env as env

vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed here (.ci/engines installs it)")
if not env.REAL_VLLM:
    pytest.skip("vLLM 0.33.0 is not installed here (.ci/engines installs it)", allow_module_level=True)

import torch  # noqa: E402

import cuda_stubs  # noqa: E402
import specplan.vllm as sp_vllm  # noqa: E402

env.prepare()

K, N = env.K, env.N
# As test_vllm_0330.py: rows out of order, contexts across a block, accept lengths 2, 4, 1, a
# first prompt chunk of K + 1 tokens, 3.
REQS = [(5, 29, N, 2), (1, 3, N, N), (6, 60, N, 1), (2, 0, N, 0), (0, 41, N, 3)]
LOGIT_TIE = 0.1

CASES = {
    "eagle3-LBNHC": dict(eagle3=True, layout="LBNHC"),
    "eagle3-LBHNC": dict(eagle3=True, layout="LBHNC"),
    "eagle1-LBNHC": dict(eagle3=False, layout="LBNHC"),
}
_BUILT = {}


def _valid(q, a):
    return a if a else q


def built(name):
    if name not in _BUILT:
        case = env.Case(**CASES[name], plan_flags={"draft_decode_steps": str(K)})
        case.bind()
        batch = env.Batch(case, REQS, pad_tokens=4)
        calls = []
        from specplan import _decode

        run = _decode.DraftDecodeRunner.run

        def spy(self, *args, **kwargs):
            calls.append([a.clone() for a in args])
            return run(self, *args, **kwargs)

        _decode.DraftDecodeRunner.run = spy
        try:
            sp = env.propose(case, batch)
        finally:
            _decode.DraftDecodeRunner.run = run
        vl = env.propose(case, batch, vllm_prefill=True)
        _BUILT[name] = types.SimpleNamespace(case=case, batch=batch, sp=sp, vl=vl, calls=calls)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def cmp(request):
    return built(request.param)


@pytest.fixture(scope="module", autouse=True)
def _uninstall_after():
    yield
    sp_vllm.uninstall()


def _chain_slots(c, b):
    """Per request, the slots of positions L .. L+K−2 (L: the committed length) through the
    persistent block table row idx_mapping[r]."""
    table = c.bt.block_tables[0].gpu
    out = []
    for r, (row, ctx, q, a) in enumerate(REQS):
        L = ctx + _valid(q, a)
        out.append(torch.tensor([int(table[row, p // c.block]) * c.block + p % c.block for p in range(L, L + K - 1)]))
    return out


def test_specplan_runs_both_phases_and_hands_the_phase_vllms_state(cmp):
    c, b = cmp.case, cmp.batch
    assert cmp.sp.prefills == 1 and len(cmp.calls) == 1, "the chain ran once, as the plan's phase"
    assert len(cmp.sp.logits) == 0, "vLLM's decode loop did not run: no draft logits computed"
    assert len(cmp.vl.logits) == K
    p, ids, hidden, rows, prefix = cmp.calls[0]
    R = b.R
    assert p.dtype == torch.float32 and torch.equal(p, torch.ones(R, 1))
    assert ids.dtype == torch.int64 and torch.equal(ids[:, 0], cmp.sp.first["draft0"])
    assert hidden.dtype == torch.bfloat16 and torch.equal(hidden, cmp.sp.first["hidden"])
    assert torch.equal(rows, b.idx_mapping)
    want = torch.tensor([ctx + _valid(q, a) for (_, ctx, q, a) in REQS])
    assert torch.equal(prefix, want), "the chain starts at the committed length"
    assert c.s.specplan_report() == []
    assert not cuda_stubs.CALLS, f"a CUDA-only stub ran: {cuda_stubs.CALLS}"


def test_drafts_match_vllms_own_step(cmp):
    sp, vl = cmp.sp, cmp.vl
    R = cmp.batch.R
    assert sp.drafts.dtype == torch.int64 and tuple(sp.drafts.shape) == (R, K)
    assert sp.returned.data_ptr() == cmp.case.s.draft_tokens.data_ptr()
    differ = 0
    for r in range(R):
        for j in range(K):
            a, b_ = int(sp.drafts[r, j]), int(vl.drafts[r, j])
            if a == b_:
                continue
            lv = vl.logits[j][r]
            assert lv[b_] - lv[a] <= LOGIT_TIE, f"request {r} step {j}: {a} vs vLLM's {b_} ({lv[b_] - lv[a]:.3f})"
            differ += 1
            break
    assert differ <= 1, (sp.drafts, vl.drafts)


def test_chain_kv_lands_at_the_block_tables_slots_and_nothing_else(cmp):
    c, b = cmp.case, cmp.batch
    chain = _chain_slots(c, b)
    same = [bool(torch.equal(cmp.sp.drafts[r], cmp.vl.drafts[r])) for r in range(b.R)]
    for r, slots in enumerate(chain):
        got, want, before = (c.slot_kv(kv, slots) for kv in (cmp.sp.kv, cmp.vl.kv, c.kv0))
        assert bool(((want.float() - before.float()).abs().amax(dim=(1, 2)) > 0).all()), "vLLM wrote every step"
        if same[r]:
            assert env.close(got, want, 1e-2), f"request {r}: chain K/V"
    written = torch.cat([b.slots] + chain)
    assert c.unchanged_outside(cmp.sp.kv, written)
