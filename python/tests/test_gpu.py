"""GPU tests of DraftExtendRunner with real PyTorch tensors (the GPU machine runs them; elsewhere
they print SKIP). The reference is the PyTorch draft head of examples/eagle_e2e.py."""

import importlib.util
import os
import sys

import pytest

import specplan

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    print("SKIP: no CUDA device (GPU tests of specplan.DraftExtendRunner)")
    pytest.skip("no CUDA device", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "eagle_e2e", os.path.join(os.path.dirname(__file__), "..", "examples", "eagle_e2e.py")
)
e2e = importlib.util.module_from_spec(_spec)
sys.modules["eagle_e2e"] = e2e
_spec.loader.exec_module(e2e)

PLAN_PATH = os.environ.get("SPECPLAN_TEST_PLAN")


@pytest.fixture(scope="module")
def setup():
    plan = specplan.Plan.load(PLAN_PATH) if PLAN_PATH else specplan.Plan.compile(preset="tiny", max_requests=16)
    return e2e.Setup(plan, 5, seed=7)


def _inputs(s, prefix_len=30):
    n, h = s.plan.num_draft_tokens, s.plan.hidden_size
    ids = torch.randint(0, s.plan.vocab_size, (s.b, n), device=s.dev)
    hid = torch.randn(s.b, n, h, device=s.dev).to(s.act)
    prefix = torch.full((s.b,), prefix_len, dtype=torch.long, device=s.dev) + torch.arange(s.b, device=s.dev)
    accept = torch.randint(1, n + 1, (s.b,), device=s.dev)
    return ids, hid, prefix, accept


def test_a_step_matches_the_pytorch_head(setup):
    s = setup
    for k in s.kd + s.vd:
        k.normal_()
    ids, hid, prefix, accept = _inputs(s)
    diff, _ = e2e.compare_step(s, ids, hid, prefix, accept)
    assert diff["prob_bad"] == 0 and diff["id_bad"] == 0, diff
    assert diff["hidden_rel"] < 1e-2 and diff["kv_rel"] < 1e-2, diff
    assert s.runner.last_error() is None


def test_bad_tensors_are_refused_before_launch(setup):
    s, r = setup, setup.runner
    ids, hid, prefix, accept = _inputs(s)
    flat, hflat = ids.reshape(-1), hid.reshape(-1, hid.shape[-1])
    with pytest.raises(TypeError, match="input_ids: dtype"):
        r.run(flat.float(), hflat, s.req, prefix, accept)
    with pytest.raises(TypeError, match="hidden_states: dtype"):
        r.run(flat, hflat.float(), s.req, prefix, accept)
    with pytest.raises(ValueError, match="accept_lens: on cpu"):
        r.run(flat, hflat, s.req, prefix, accept.cpu())
    with pytest.raises(ValueError, match="hidden_states: must be contiguous"):
        r.run(flat, torch.empty(hid.shape[-1], flat.numel(), device=s.dev, dtype=s.act).t(), s.req, prefix, accept)
    with pytest.raises(ValueError, match="prefix_lens: shape"):
        r.run(flat, hflat, s.req, prefix[:-1], accept)


def test_a_refused_request_writes_nothing_and_is_reported(setup):
    s, r = setup, setup.runner
    ids, hid, prefix, accept = _inputs(s)
    accept[2] = 0
    r._out_p.fill_(float("nan"))
    out = r.run(ids.reshape(-1), hid.reshape(-1, hid.shape[-1]), s.req, prefix, accept)
    err = r.last_error()
    assert err is not None and (err.count, err.request) == (1, 2) and "accept" in err.rule, err
    # Its outputs are zeros (never a stale row of another step), its K/V unwritten.
    assert bool((out.topk_p[2] == 0).all()) and bool((out.topk_index[2] == 0).all()), "refused row not zeroed"
    assert torch.isfinite(out.topk_p[:2]).all() and torch.isfinite(out.topk_p[3:]).all()
    accept[2] = 1
    r.run(ids.reshape(-1), hid.reshape(-1, hid.shape[-1]), s.req, prefix, accept)
    assert r.last_error() is None, "a good step after a bad one reports nothing"


def test_a_step_inside_a_stream_capture_is_refused(setup):
    s, r = setup, setup.runner
    ids, hid, prefix, accept = _inputs(s)
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(ValueError, match="captured"):
            with torch.cuda.graph(g, stream=stream):
                r.run(ids.reshape(-1), hid.reshape(-1, hid.shape[-1]), s.req, prefix, accept)


def test_inputs_freed_right_after_run_are_safe(setup):
    """The caching allocator hands a freed input's memory only to later work on the same
    stream, which runs after the step: a step's inputs may be dropped as soon as run returns."""
    s, r = setup, setup.runner
    ids, hid, prefix, accept = _inputs(s)
    want = s.extend("torch", ids, hid, prefix, accept)
    a, b_, c = ids.reshape(-1).clone(), hid.reshape(-1, hid.shape[-1]).clone(), accept.int().clone()
    out = r.run(a, b_, s.req, prefix, c)
    del a, b_, c
    junk = [torch.full((s.b * s.plan.num_draft_tokens * s.plan.hidden_size,), 7.0, device=s.dev, dtype=s.act)
            for _ in range(4)]
    torch.cuda.synchronize()
    assert len(junk) == 4
    assert torch.equal(out.topk_index[:, 0], want[1][:, 0]) or e2e.top1_gap(want[0]) <= e2e.TIE
    rel = (out.hidden_states.float() - want[2].float()).norm() / want[2].float().norm()
    assert rel < 1e-2


def _eagle3_reference(plan, w, kpools, vpools, table, req, ids, hidden, prefix, accept):
    """The EAGLE-3 head in PyTorch (docs/semantics.md): bf16 GEMMs accumulating in fp32."""
    act = torch.bfloat16
    b, n = ids.shape
    hq, hkv, d, eps = plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.rms_norm_eps
    inv = torch.tensor(plan.rope_inv_freq, device=ids.device)
    pos = prefix[:, None] + torch.arange(n, device=ids.device)[None, :]
    h = hidden.reshape(b * n, -1) @ w["fc.weight"].t()
    e = w["embed_tokens.weight"][ids].reshape(b * n, -1)
    a = torch.cat([e2e.rmsnorm(e, w["midlayer.input_layernorm.weight"], eps).to(act),
                   e2e.rmsnorm(h, w["midlayer.hidden_norm.weight"], eps).to(act)], -1)
    q = (a @ w["midlayer.self_attn.q_proj.weight"].t()).view(b * n, hq, d)
    k = (a @ w["midlayer.self_attn.k_proj.weight"].t()).view(b * n, hkv, d)
    v = (a @ w["midlayer.self_attn.v_proj.weight"].t()).view(b, n, hkv, d)
    q = e2e.rope(q.float(), pos.reshape(-1), inv).to(act).view(b, n, hq, d)
    k = e2e.rope(k.float(), pos.reshape(-1), inv).to(act).view(b, n, hkv, d)
    full = torch.full_like(prefix, n)
    e2e.write_kv(kpools[0], table, req, pos, full, k)
    e2e.write_kv(vpools[0], table, req, pos, full, v)
    o = e2e.attend(q, kpools[0], vpools[0], table, req, pos, prefix + full, None, act)
    x = torch.addmm(h, o.reshape(b * n, -1), w["midlayer.self_attn.o_proj.weight"].t())
    m = e2e.rmsnorm(x, w["midlayer.post_attention_layernorm.weight"], eps).to(act)
    mid = (torch.nn.functional.silu((m @ w["midlayer.mlp.gate_proj.weight"].t()).float())
           * (m @ w["midlayer.mlp.up_proj.weight"].t()).float()).to(act)
    x = torch.addmm(x, mid, w["midlayer.mlp.down_proj.weight"].t()).view(b, n, -1)
    pre = x[torch.arange(b, device=x.device), accept - 1]
    logits = e2e.rmsnorm(pre, w["norm.weight"], eps).to(act).float() @ w["lm_head.weight"].float().t()
    tp, ti = torch.topk(torch.softmax(logits, -1), plan.topk, dim=-1)
    return tp, ti + w["d2t"][ti], pre


def test_an_eagle3_plan_runs_with_the_same_api():
    here = os.path.dirname(__file__)
    plan = specplan.Plan.compile(hf_config=os.path.join(here, "..", "..", "tests", "corpus", "valid", "tiny-eagle3.json"),
                                 num_draft_tokens=4, topk=4, num_steps=3, buckets=[1, 2, 4, 8], page_size=1,
                                 max_context_len=512, max_requests=16)
    assert plan.head == "eagle3" and plan.hidden_in_size == 3 * 192 and plan.draft_vocab_size == 600
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(3)
    h, vd, v = plan.hidden_size, plan.draft_vocab_size, plan.vocab_size
    w = e2e.draft_weights_eagle3(plan, gen, dev)
    b, n, slots = 5, plan.num_draft_tokens, 4096
    table = torch.randperm(slots, generator=gen, device=dev)[: 8 * 256].int().view(8, 256)
    kp = [torch.randn(slots, plan.num_kv_heads, plan.head_dim, generator=gen, device=dev).to(torch.bfloat16)]
    vp = [torch.randn(slots, plan.num_kv_heads, plan.head_dim, generator=gen, device=dev).to(torch.bfloat16)]
    runner = specplan.DraftExtendRunner(plan, w, kp, vp, req_to_token=table)
    req = torch.tensor([3, 0, 6, 1, 5], device=dev)
    ids = torch.randint(0, v, (b, n), generator=gen, device=dev)
    hidden = torch.randn(b, n, plan.hidden_in_size, generator=gen, device=dev).to(torch.bfloat16)
    prefix = torch.randint(0, 200, (b,), generator=gen, device=dev)
    accept = torch.randint(1, n + 1, (b,), generator=gen, device=dev)
    kref, vref = [kp[0].clone()], [vp[0].clone()]
    tp, ti, pre = _eagle3_reference(plan, w, kref, vref, table, req, ids, hidden, prefix, accept)
    out = runner.run(ids.reshape(-1), hidden.reshape(b * n, -1), req, prefix, accept)
    torch.cuda.synchronize()
    assert runner.last_error() is None
    rel = (out.hidden_states.float() - pre.float()).norm() / pre.float().norm()
    assert rel < 1e-2, f"hidden_states (pre-norm) rel {rel}"
    assert ((out.topk_p - tp).abs() <= 2e-2 * tp + 2e-3).all()
    same = out.topk_index[:, 0] == ti[:, 0]
    assert bool(same.all()) or e2e.top1_gap(tp) <= e2e.TIE, "target ids after d2t"
    assert bool(((out.topk_index >= 0) & (out.topk_index < v)).all())
    krel = (kp[0].float() - kref[0].float()).norm() / kref[0].float().norm()
    assert krel < 1e-2
