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
        r.run(flat.int(), hflat, s.req, prefix, accept)
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
    assert torch.isnan(out.topk_p[2]).all(), "the refused request's outputs were written"
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
