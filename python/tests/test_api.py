"""Tests that need no GPU and no PyTorch: plans (load, compile, facts, errors) and the
runner's argument checks, with a light stand-in for torch (what CI runs)."""

import json
import os
import sys
import types

import pytest

import specplan


def test_compile_a_preset_without_a_gpu():
    plan = specplan.Plan.compile(preset="tiny")
    assert plan.buckets == sorted(plan.buckets) and plan.buckets
    assert plan.has_kernels, "NVRTC is found without environment variables"
    assert (plan.num_draft_tokens, plan.topk, plan.dtype) == (4, 4, "bf16")
    assert plan.hidden_size > 0 and plan.vocab_size > 0 and plan.num_layers > 0
    assert plan.num_kv_heads > 0 and plan.head_dim > 0 and plan.page_size >= 1
    names = [w[0] for w in plan.weights()]
    assert "embed_tokens.weight" in names and "lm_head.weight" in names


def test_compile_flags_and_errors(tmp_path):
    plan = specplan.Plan.compile(preset="tiny", num_draft_tokens=8, buckets=[1, 2, 4], page_size=1, no_kernels=True)
    assert plan.buckets == [1, 2, 4] and plan.num_draft_tokens == 8 and not plan.has_kernels
    with pytest.raises(TypeError, match="did you mean `page_size`"):
        specplan.Plan.compile(preset="tiny", page_sise=16)
    with pytest.raises(TypeError, match="max_bs"):
        specplan.Plan.compile(preset="tiny", max_bs="lots")
    with pytest.raises(ValueError, match="no_such_preset|preset"):
        specplan.Plan.compile(preset="no_such_preset")
    with pytest.raises(ValueError, match="exactly one"):
        specplan.Plan.compile()


def test_save_load_round_trip_and_bad_files(tmp_path):
    plan = specplan.Plan.compile(preset="tiny", no_kernels=True)
    path = tmp_path / "tiny.plan"
    plan.save(path)
    again = specplan.Plan.load(path)
    assert again.text() == plan.text()
    bad = tmp_path / "bad.plan"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="cannot load plan"):
        specplan.Plan.load(bad)
    with pytest.raises(ValueError, match="cannot load plan"):
        specplan.Plan.load(tmp_path / "missing.plan")
    assert sorted(os.listdir(tmp_path)) == ["bad.plan", "tiny.plan"], "no temporary file left behind"


def test_doctor_reports_nvrtc_and_driver():
    r = specplan.doctor()
    assert "nvrtc_origin" in r or "nvrtc_error" in r
    assert "driver" in r and "would_fail" in r


# ---- a stand-in for torch: enough of its surface for the runner's checks ----


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


class _Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __eq__(self, other):
        return isinstance(other, _Device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        return f"{self.type}:{self.index}" if self.index is not None else self.type


def _fake_torch():
    t = types.ModuleType("torch")
    for n in ["bfloat16", "float16", "float32", "int64", "int32"]:
        setattr(t, n, _Dtype(n))
    cuda0 = _Device("cuda", 0)

    class Tensor:
        _next = 0x7F0000000000

        def __init__(self, shape, dtype, device=cuda0, strides=None, neg=False):
            self.shape = tuple(shape)
            self.dtype = dtype
            self.device = device
            self._neg = neg
            if strides is None:
                strides, acc = [], 1
                for s in reversed(self.shape):
                    strides.insert(0, acc)
                    acc *= s
            self._strides = tuple(strides)
            Tensor._next += 1 << 20
            self._ptr = Tensor._next

        def stride(self, i=None):
            return self._strides if i is None else self._strides[i]

        def dim(self):
            return len(self.shape)

        def numel(self):
            n = 1
            for s in self.shape:
                n *= s
            return n

        def data_ptr(self):
            return self._ptr

        def is_neg(self):
            return self._neg

        def is_conj(self):
            return False

        def get_device(self):
            return self.device.index if self.device.type == "cuda" else -1

        def is_contiguous(self):
            return self._strides == Tensor(self.shape, self.dtype)._strides

        def __getitem__(self, s):
            return self

    t.Tensor = Tensor
    t.empty = lambda shape, dtype=None, device=None: Tensor(shape, dtype, device or cuda0)
    t.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        device=lambda i: _Null(),
        current_stream=lambda i=None: types.SimpleNamespace(cuda_stream=0),
    )
    t._C = types.SimpleNamespace()
    return t, cuda0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture
def fake(monkeypatch):
    torch, cuda0 = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch, cuda0


def _pools(torch, plan, n_slots=64, dtype=None, layers=None):
    dt = dtype or torch.bfloat16
    shape = (n_slots, plan.num_kv_heads, plan.head_dim)
    return [torch.Tensor(shape, dt) for _ in range(layers or plan.num_layers)]


def test_runner_registration_checks_name_the_argument(fake):
    torch, cuda0 = fake
    plan = specplan.Plan.compile(preset="tiny")
    k, v = _pools(torch, plan), _pools(torch, plan)
    table = torch.Tensor((8, 128), torch.int32)
    R = specplan.DraftExtendRunner
    with pytest.raises(TypeError, match=r"k_cache\[0\]: dtype torch.float32"):
        R(plan, {}, _pools(torch, plan, dtype=torch.float32), v, req_to_token=table)
    with pytest.raises(ValueError, match=r"k_cache: expected a list of 1 tensors|k_cache: expected a list of"):
        R(plan, {}, k + k, v, req_to_token=table)
    with pytest.raises(ValueError, match="exactly one of req_to_token"):
        R(plan, {}, k, v)
    with pytest.raises(ValueError, match="exactly one of req_to_token"):
        R(plan, {}, k, v, req_to_token=table, block_table=table)
    with pytest.raises(TypeError, match="req_to_token: dtype torch.int64"):
        R(plan, {}, k, v, req_to_token=torch.Tensor((8, 128), torch.int64))
    with pytest.raises(ValueError, match=r"k_cache\[0\]: shape"):
        R(plan, {}, [torch.Tensor((64, 3, 5), torch.bfloat16)] * plan.num_layers, v, req_to_token=table)
    bad_stride = [torch.Tensor((64, plan.num_kv_heads, plan.head_dim), torch.bfloat16,
                               strides=(plan.num_kv_heads * plan.head_dim, 1, plan.num_kv_heads))] * plan.num_layers
    with pytest.raises(ValueError, match="contiguous"):
        R(plan, {}, bad_stride, v, req_to_token=table)
    with pytest.raises(TypeError, match=r"weights\['w'\]: expected a torch.Tensor"):
        R(plan, {"w": 3}, k, v, req_to_token=table)
    with pytest.raises(ValueError, match="on cpu"):
        R(plan, {"w": torch.Tensor((4,), torch.bfloat16, device=_Device("cpu"))}, k, v, req_to_token=table)
    with pytest.raises(TypeError, match="plan: expected a specplan.Plan"):
        R("tiny.plan", {}, k, v, req_to_token=table)
    # The graphs' L2 prefetch branches: checked before anything touches the device.
    with pytest.raises(TypeError, match="l2_prefetch: expected a str"):
        R(plan, {}, k, v, req_to_token=table, l2_prefetch=32)
    for bad, why in [("99", "MiB must be 1 to 48"), ("32x0", "CTAs must be 1 to 1024"), ("32/0", "the largest bucket after `/` must be a positive integer")]:
        with pytest.raises(ValueError, match=f"l2_prefetch: l2 prefetch `{bad}`: {why}"):
            R(plan, {}, k, v, req_to_token=table, l2_prefetch=bad)
    # Every host check passed: the native side needs a GPU, which this machine lacks (or
    # the stand-in pointers are refused) -- either way a clear error, no crash.
    with pytest.raises((RuntimeError, ValueError)):
        R(plan, {}, k, v, req_to_token=table)
    # block_size applies to a block table: beside req_to_token it would be ignored.
    with pytest.raises(ValueError, match="block_size: applies to block_table"):
        R(plan, {}, k, v, req_to_token=table, block_size=16)
    with pytest.raises(ValueError, match=r"block_size: 18446744073709551616 is outside"):
        R(plan, {}, k, v, req_to_token=table, block_size=2**64)


class _RecordingEngine:
    def __init__(self):
        self.calls = []

    def step(self, *args):
        self.calls.append(args)

    def draft_decode(self, *args, **kwargs):
        self.calls.append(args + ((kwargs,) if kwargs else ()))

    def can_run(self, b):
        return b <= 8


def _bare_engine(torch, plan):
    """An Engine whose native engine records its calls (the host checks are what is tested)."""
    e = object.__new__(specplan.Engine)
    e.plan, e._torch, e._act = plan, torch, torch.bfloat16
    e._device, e._index, e._cuda = _Device("cuda", 0), 0, True
    e._engine = _RecordingEngine()
    e._stream = lambda: 0x5EED
    e._runners = {}
    return e


def _bare_runner(torch, plan):
    """A draft-extend runner on a recording engine, built as `engine.draft_extend()` builds it."""
    return _bare_engine(torch, plan).draft_extend()


def test_engine_runners_share_one_registration_and_read_the_signature(fake):
    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny", outputs="topk,logits")
    assert [p[0] for p in plan.phases()] == ["draft_extend"]
    kind, rows, buckets = plan.phases()[0]
    assert rows == plan.num_draft_tokens and buckets == plan.buckets
    sig = {name: (dt, shape, role) for name, dt, shape, role, _ in plan.signature(3)}
    assert sig["input_ids"] == ("i64", [3 * rows], "staged")
    assert sig["hidden_states"] == ("bf16", [3 * rows, plan.hidden_in_size], "staged")
    assert sig["logits"] == ("f32", [3, plan.logits_size], "output")
    assert sig["k_cache"][2] == "engine" and sig["page_table"][0] == "i32"
    with pytest.raises(ValueError, match='phase "draft_decode": the plan has draft_extend'):
        plan.signature(1, "draft_decode")
    e = _bare_engine(torch, plan)
    r = e.draft_extend()
    assert e.draft_extend() is r and e.draft_extend(plan) is r, "one runner per phase and engine"
    assert r.engine is e and r._engine is e._engine, "the runner uses the engine's registration"
    assert tuple(r._out_l.shape) == (plan.max_requests, plan.logits_size)
    other = specplan.Plan.compile(preset="tiny", page_size=8)
    with pytest.raises(ValueError, match="the plan it registered"):
        e.draft_extend(other)


def test_run_checks_every_input_before_launching(fake):
    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny")
    r = _bare_runner(torch, plan)
    b, n, h = 3, plan.num_draft_tokens, plan.hidden_size
    ids = torch.Tensor((b * n,), torch.int64)
    hid = torch.Tensor((b * n, h), torch.bfloat16)
    req = torch.Tensor((b,), torch.int64)
    pre = torch.Tensor((b,), torch.int32)
    acc = torch.Tensor((b,), torch.int32)
    out = r.run(ids, hid, req, pre, acc, prefix_includes_new_tokens=True)
    (call,) = r._engine.calls
    # (b, ids, ids_i32, hidden, req, req_i32, prefix, prefix_i32, bias, accept, accept_i32,
    #  accept_select, out_p, out_i, out_h, out_logits, stream)
    assert call[0] == b and call[1] == ids.data_ptr() and call[2] is False and call[3] == hid.data_ptr()
    assert call[5] is False and call[7] is True and call[8] == -n and call[10] is True and call[11] is False
    assert call[15] == 0 and call[-1] == 0x5EED
    assert out is r.run(ids, hid, req, pre, acc), "views are cached per batch size"
    cases = [
        ((torch.Tensor((b * n,), torch.float32), hid, req, pre, acc), TypeError, "input_ids: dtype"),
        ((torch.Tensor((b * n + 1,), torch.int64), hid, req, pre, acc), ValueError, "input_ids: shape"),
        ((ids, torch.Tensor((b * n, h), torch.float16), req, pre, acc), TypeError, "hidden_states: dtype"),
        ((ids, torch.Tensor((b * n, h + 1), torch.bfloat16), req, pre, acc), ValueError, "hidden_states: shape"),
        ((ids, hid, torch.Tensor((b,), torch.float32), pre, acc), TypeError, "req_pool_indices: dtype"),
        ((ids, hid, req, torch.Tensor((b + 1,), torch.int32), acc), ValueError, r"prefix_lens: shape \(4,\)"),
        ((ids, hid, req, pre, torch.Tensor((b,), torch.int32, device=_Device("cpu"))), ValueError, "accept_lens: on cpu"),
        ((ids, hid, req, pre, torch.Tensor((b, 2), torch.int32, strides=(1, b))), ValueError, "accept_lens: shape"),
        ((ids, hid, req, pre, [1, 2, 3]), TypeError, "accept_lens: expected a torch.Tensor"),
        # Memory that does not hold the values: a lazily negated view, the meta device.
        ((ids, torch.Tensor((b * n, h), torch.bfloat16, neg=True), req, pre, acc), ValueError,
         "hidden_states: a lazily negated"),
        ((ids, hid, req, torch.Tensor((b,), torch.int32, device=_Device("meta")), acc), ValueError,
         "prefix_lens: on the meta device"),
    ]
    for args, exc, msg in cases:
        before = len(r._engine.calls)
        with pytest.raises(exc, match=msg):
            r.run(*args)
        assert len(r._engine.calls) == before, f"{msg}: nothing launched"
    big = plan.max_requests + 1
    with pytest.raises(ValueError, match="outside"):
        r.run(torch.Tensor((big * n,), torch.int64), torch.Tensor((big * n, h), torch.bfloat16),
              torch.Tensor((big,), torch.int64), torch.Tensor((big,), torch.int64), torch.Tensor((big,), torch.int64))
    with pytest.raises(ValueError, match=r"prefix_lens_cpu\[1\]"):
        r.run(ids, hid, req, pre, acc, prefix_lens_cpu=[0, plan.max_context_len, 0])
    # can_run: any integer (out of range: False), not a string or a bool.
    assert [r.can_run(x) for x in (1, 8, 9, 0, -1, 2**70)] == [True, True, False, False, False, False]
    for bad in ("x", 1.0, True):
        with pytest.raises(TypeError, match="batch_size: expected an int"):
            r.can_run(bad)
    # A flag must be a bool: the string "False" is truthy.
    before = len(r._engine.calls)
    with pytest.raises(TypeError, match="prefix_includes_new_tokens: expected a bool"):
        r.run(ids, hid, req, pre, acc, prefix_includes_new_tokens="False")
    assert len(r._engine.calls) == before


def test_draft_decode_runner_names_its_tier_and_checks_inputs(fake):
    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny", speculative_eagle_topk=1, speculative_num_steps=3,
                                 speculative_num_draft_tokens=4, draft_decode_steps="2,3", page_size=1)
    assert [p[0] for p in plan.phases()] == ["draft_extend", "draft_decode:2", "draft_decode:3"]
    e = _bare_engine(torch, plan)
    with pytest.raises(ValueError, match=r"steps 5: the plan's draft-decode tiers are \[2, 3\]"):
        e.draft_decode(5)
    r = e.draft_decode()
    assert r.steps == 3 and e.draft_decode(3) is r and e.draft_decode(2) is not r
    assert r.num_draft_tokens == 4 and r._pw == 2 * 1 + 1
    assert e.draft_decode(2).num_draft_tokens == 3, "a tier other than num_steps has N = S + 1"
    b, k, h = 3, 1, plan.hidden_size
    p = torch.Tensor((b, k), torch.float32)
    ids = torch.Tensor((b, k), torch.int64)
    hid = torch.Tensor((b, h), torch.bfloat16)
    req = torch.Tensor((b,), torch.int64)
    pre = torch.Tensor((b,), torch.int32)
    out = r.run(p, ids, hid, req, pre)
    (call,) = r._engine.calls
    # (phase, b, probs, ids, ids_i32, hidden, req, req_i32, prefix, prefix_i32, bias,
    #  out_parents, out_index, out_tokens, stream)
    assert call[:2] == ("draft_decode:3", b) and call[2] == p.data_ptr() and call[4] is False
    assert call[7] is False and call[9] is True and call[10] == 0 and call[-1] == 0x5EED
    assert out is r.run(p, ids, hid, req, pre), "views are cached per batch size"
    cases = [
        ((torch.Tensor((b, k), torch.bfloat16), ids, hid, req, pre), TypeError, "topk_p: dtype"),
        ((p, torch.Tensor((b, k + 1), torch.int64), hid, req, pre), ValueError, "topk_index: shape"),
        ((p, ids, torch.Tensor((b, h), torch.float16), req, pre), TypeError, "hidden_states: dtype"),
        ((p, ids, hid, req, torch.Tensor((b + 1,), torch.int32)), ValueError, "prefix_lens: shape"),
        ((p, ids, hid, torch.Tensor((b,), torch.int64, device=_Device("cpu")), pre), ValueError,
         "req_pool_indices: must be contiguous on cuda"),
        ((p, ids, [0.0] * h, req, pre), TypeError, "hidden_states: expected a torch.Tensor"),
    ]
    for args, exc, msg in cases:
        before = len(r._engine.calls)
        with pytest.raises(exc, match=msg):
            r.run(*args)
        assert len(r._engine.calls) == before, f"{msg}: nothing launched"
    mem = plan.memory()
    assert sorted(mem) == ["draft_decode:2", "draft_decode:3", "draft_extend"]
    # A chain of S steps at page 1 writes S − 1 positions past the prefix; draft-extend N.
    assert mem["draft_decode:3"]["positions_per_request"] == 2 and mem["draft_decode:2"]["positions_per_request"] == 1
    assert mem["draft_extend"]["positions_per_request"] == 4
    for m in mem.values():
        assert m["arena_bytes"] == max(m["bucket_arena_bytes"].values()) > 0
    with pytest.raises(ValueError, match="bonus_tokens: the plan emits no verify inputs"):
        r.run(p, ids, hid, req, pre, bonus_tokens=req)
    # The verify inputs: bonus_tokens required, six more outputs passed by address.
    vplan = specplan.Plan.compile(preset="tiny", speculative_eagle_topk=4, speculative_num_steps=3,
                                  speculative_num_draft_tokens=8, draft_decode_steps="3", page_size=1,
                                  draft_decode_outputs="tree,verify")
    sig = {name: (dt, shape, role) for name, dt, shape, role, _ in vplan.signature(2, "draft_decode:3")}
    assert sig["bonus_tokens"] == ("i64", [2], "staged") and sig["tree_mask"] == ("i32", [2, 8, 8], "output")
    vr = _bare_engine(torch, vplan).draft_decode()
    vp, vi, vh = torch.Tensor((b, 4), torch.float32), torch.Tensor((b, 4), torch.int64), hid
    with pytest.raises(ValueError, match="bonus_tokens: the plan emits the verify inputs"):
        vr.run(vp, vi, vh, req, pre)
    with pytest.raises(ValueError, match="bonus_tokens: shape"):
        vr.run(vp, vi, vh, req, pre, bonus_tokens=torch.Tensor((b + 1,), torch.int64))
    out = vr.run(vp, vi, vh, req, pre, bonus_tokens=torch.Tensor((b,), torch.int32))
    kw = vr._engine.calls[-1][-1]
    assert kw["bonus_i32"] is True and len(kw["out_verify"]) == 5 and kw["out_mask"] == vr._mask.data_ptr()
    assert out.tree_mask is not None and out.verify_positions is not None
    plain = specplan.Plan.compile(preset="tiny")
    with pytest.raises(ValueError, match="no draft-decode phase"):
        _bare_engine(torch, plain).draft_decode()


def test_both_engines_take_the_same_draft_decode_arguments():
    # The decode runner calls `draft_decode` identically on the CUDA `Engine` and the
    # `CpuEngine`: the two bindings must keep one signature.
    from specplan import _native

    cuda, cpu = _native.Engine.draft_decode.__text_signature__, _native.CpuEngine.draft_decode.__text_signature__
    assert cuda is not None and cuda == cpu, (cuda, cpu)
    for arg in ("bonus", "out_verify", "out_mask", "stream"):
        assert arg in cuda


def test_sglang_slot_passes_sglangs_fields(fake):
    """The slot's `execute(forward_batch, select_index)` hands SGLang 0.5.23's fields to the
    runner as they are (seq_lens = L + N with bias -N, select_index as the selected rows, a
    fresh hidden tensor per step) and returns the logits and hidden rows. The same contract
    against SGLang's own classes: tests/engines/test_sglang_0523.py."""
    from specplan.sglang import SGLangDraftExtendRunner

    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny", outputs="logits")
    r = _bare_runner(torch, plan)
    a = SGLangDraftExtendRunner(r)
    b, n, h = 2, plan.num_draft_tokens, plan.hidden_size
    spec = types.SimpleNamespace(hidden_states=torch.Tensor((b * n, h), torch.bfloat16), num_tokens_per_req=n)
    fb = types.SimpleNamespace(
        input_ids=torch.Tensor((b * n,), torch.int64), req_pool_indices=torch.Tensor((b,), torch.int64),
        seq_lens=torch.Tensor((b,), torch.int64), spec_info=spec,
    )
    select = torch.Tensor((b,), torch.int64)
    r.poll_error = lambda: ([], False)
    out = a.execute(fb, select)
    (call,) = r._engine.calls
    assert call[8] == -n, "seq_lens count the N new tokens"
    assert call[9] == select.data_ptr() and call[11] is True, "select_index gives the selected rows"
    assert call[15] == r._out_l.data_ptr() and call[14] != r._out_h.data_ptr(), "a fresh hidden tensor"
    assert out.next_token_logits is not None and out.hidden_states is not None


def test_rebuilt_kernels_equal_the_honest_ones(tmp_path):
    plan = specplan.Plan.compile(preset="tiny")
    path = tmp_path / "tiny.plan"
    plan.save(path)
    rebuilt = specplan.Plan.load(path, rebuild_kernels=True)
    assert rebuilt.has_kernels and rebuilt.text() == plan.text()


def test_an_eagle3_plan_reports_its_head():
    here = os.path.dirname(__file__)
    cfg = os.path.join(here, "..", "..", "tests", "corpus", "valid", "tiny-eagle3.json")
    plan = specplan.Plan.compile(hf_config=cfg, num_draft_tokens=4, topk=4, num_steps=3, buckets=[1, 2],
                                 max_context_len=512, no_kernels=True)
    assert (plan.head, plan.hidden_in_size, plan.draft_vocab_size, plan.vocab_size) == ("eagle3", 576, 600, 1000)
    names = [w[0] for w in plan.weights()]
    assert "d2t" in names and "norm.weight" in names and "midlayer.self_attn.qkv_proj.weight" in names


def test_save_follows_the_cli_output_rules(tmp_path):
    """Plan.save writes through the CLI's output code: a character device and a FIFO are
    written through (never replaced by a regular file), a symbolic link is followed, a
    read-only file is refused untouched. Every node is made here, in a temporary folder
    (never the machine's own /dev/null)."""
    import stat
    import threading

    plan = specplan.Plan.compile(preset="tiny", no_kernels=True)
    # A character device like /dev/null (1, 3), made in the temp folder.
    dev = tmp_path / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        dev = None
    if dev is not None:
        plan.save(dev)
        assert stat.S_ISCHR(os.stat(dev).st_mode), "the device node was replaced"
    # A FIFO: written through while a reader drains it.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    plan.save(fifo)
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced"
    assert got and specplan.Plan.from_bytes(got[0]).text() == plan.text()
    # A symbolic link: followed, the link kept.
    target = tmp_path / "real.plan"
    target.write_bytes(b"old")
    link = tmp_path / "link.plan"
    os.symlink(target, link)
    plan.save(link)
    assert os.path.islink(link) and specplan.Plan.load(target).text() == plan.text()
    # A read-only file: refused, its bytes kept.
    ro = tmp_path / "ro.plan"
    ro.write_bytes(b"keep")
    os.chmod(ro, 0o444)
    with pytest.raises(ValueError, match="read-only"):
        plan.save(ro)
    assert ro.read_bytes() == b"keep"
    # A directory: refused.
    with pytest.raises(ValueError, match="cannot write"):
        plan.save(tmp_path)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary files left: {leftovers}"


def test_compile_flags_are_checked_by_type_and_alias():
    with pytest.raises(TypeError, match="page_size: .*bool"):
        specplan.Plan.compile(preset="tiny", page_size=True, no_kernels=True)
    with pytest.raises(TypeError, match="same flag"):
        specplan.Plan.compile(preset="tiny", topk=4, speculative_eagle_topk=2, no_kernels=True)
    with pytest.raises(TypeError, match="no_kernels: expected a bool"):
        specplan.Plan.compile(preset="tiny", no_kernels=1)


def test_run_refuses_layouts_and_values_it_would_misread(fake):
    """A transposed [N, b] input, a 0-dim request tensor, float host lengths and a
    non-string weights key each get an error naming the argument."""
    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny", no_kernels=True)
    r = _bare_runner(torch, plan)
    b, n, h = 3, plan.num_draft_tokens, plan.hidden_size
    assert b != n
    ids = torch.Tensor((b * n,), torch.int64)
    hid = torch.Tensor((b * n, h), torch.bfloat16)
    req, pre, acc = (torch.Tensor((b,), torch.int64) for _ in range(3))
    with pytest.raises(ValueError, match=r"input_ids: shape \(4, 3\)"):
        r.run(torch.Tensor((n, b), torch.int64), hid, req, pre, acc)
    with pytest.raises(ValueError, match=r"hidden_states: shape \(4, 3, 256\)"):
        r.run(ids, torch.Tensor((n, b, h), torch.bfloat16), req, pre, acc)
    with pytest.raises(ValueError, match=r"req_pool_indices: shape \(\)"):
        r.run(ids, hid, torch.Tensor((), torch.int64), pre, acc)
    with pytest.raises(TypeError, match=r"prefix_lens_cpu\[0\]: expected an integer"):
        r.run(ids, hid, req, pre, acc, prefix_lens_cpu=[1.5, 2, 3])
    with pytest.raises(TypeError, match="accept_is_select_index: expected a bool"):
        r.run(ids, hid, req, pre, acc, accept_is_select_index=1)
    with pytest.raises(TypeError, match="weights: keys must be tensor names"):
        r.engine._load_weights({3: torch.Tensor((4,), torch.bfloat16)})


def test_compile_notes_are_warnings_and_kept(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle"], "hidden_size": 256, "intermediate_size": 688,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1000,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
    }))
    with pytest.warns(specplan.CompileNote, match="max_position_embeddings 2048"):
        plan = specplan.Plan.compile(hf_config=cfg, topk=1, num_steps=3, num_draft_tokens=4,
                                     max_context_len=4096, no_kernels=True)
    assert len(plan.notes) == 1 and "4096" in plan.notes[0]
    plan.save(tmp_path / "p.plan")
    assert specplan.Plan.load(tmp_path / "p.plan").notes == []


def test_an_fp16_plan_makes_fp16_buffers(fake):
    torch, _ = fake
    plan = specplan.Plan.compile(preset="tiny", dtype="fp16", no_kernels=True)
    assert plan.dtype == "fp16"
    assert {dt for _, dt, _, _, _ in plan.signature(2)} == {"fp16", "i64", "i32", "f32"}
    e = _bare_engine(torch, plan)
    e._act = torch.float16
    r = e.draft_extend()
    assert r._out_h.dtype is torch.float16 and r._out_p.dtype is torch.float32


def test_tensor_parallel_plans_and_the_engines_communicator():
    # A rank's plan: its share of the heads, its shards of the checkpoint, refusals by field.
    plan = specplan.Plan.compile(preset="tiny", tp_size=2, tp_rank=1, no_kernels=True)
    assert plan.num_kv_heads == 1
    assert "tensor_parallel size=2 rank=1 embedding=replicated" in plan.text()
    with pytest.raises(ValueError, match="tp_rank"):
        specplan.Plan.compile(preset="tiny", tp_size=2, tp_rank=2, no_kernels=True)
    with pytest.raises(ValueError, match="num_attention_heads"):
        specplan.Plan.compile(preset="tiny", tp_size=8, no_kernels=True)
    # The communicator of the engines' tensor-parallel groups, as SGLang 0.5.23 and vLLM
    # 0.33.0 hold it (a ctypes.c_void_p), or an address.
    import ctypes

    from specplan._runner import _nccl_comm

    comm = ctypes.c_void_p(0x1234)
    sglang = types.SimpleNamespace(pynccl_comm=types.SimpleNamespace(comm=comm))
    vllm = types.SimpleNamespace(device_communicator=types.SimpleNamespace(pynccl_comm=types.SimpleNamespace(comm=comm)))
    assert _nccl_comm(sglang) == _nccl_comm(vllm) == _nccl_comm(comm) == _nccl_comm(0x1234) == 0x1234
    assert _nccl_comm(None) == 0
    with pytest.raises(TypeError, match="tp_group"):
        _nccl_comm(types.SimpleNamespace(pynccl_comm=None))
    with pytest.raises(TypeError, match="tp_group"):
        _nccl_comm(True)


def test_engine_adapters_match_the_engines_tensor_parallelism():
    from specplan._runner import _engine_tp

    plan1 = specplan.Plan.compile(preset="tiny", no_kernels=True)
    rank1 = specplan.Plan.compile(preset="tiny", tp_size=2, tp_rank=1, tp_embedding="vocab", no_kernels=True)
    whole = specplan.Plan.compile(preset="tiny", tp_size=2, tp_rank=1, no_kernels=True)
    never = lambda: pytest.fail("the group is asked for only when sharded")  # noqa: E731
    assert _engine_tp(plan1, "SGLang", 1, 0, never) is None
    assert _engine_tp(rank1, "SGLang", 2, 1, lambda: "group") == "group"
    with pytest.raises(ValueError, match="rank 1 of tp_size 2.*rank 0 of 2"):
        _engine_tp(rank1, "vLLM", 2, 0, never)
    with pytest.raises(ValueError, match="tp_size=2, tp_rank=0"):
        _engine_tp(plan1, "SGLang", 2, 0, never)
    with pytest.raises(ValueError, match="tp_embedding"):
        _engine_tp(whole, "SGLang", 2, 1, never)
