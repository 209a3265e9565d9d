#!/usr/bin/env python3
"""Self-test of the peer's forward and check without a GPU (needs torch; not run by CI).

FlashInfer is replaced by a stand-in whose methods bind their arguments against the real
signatures of BatchPrefillWithPagedKVCacheWrapper.__init__/plan/run, read from the wheel in
.whl/ (so a misspelt or misplaced argument fails here), repeat the wheel's host-side checks
that the peer relies on, and compute paged attention in fp32 from FlashInfer's documented
semantics (bottom-right causal alignment, window_left). CUDA graphs are replaced by re-running
the forward. Then, on `tiny` plans (GQA, 2 layers, page size 4; sliding window + FR-Spec;
fp16 with page size 1) and on tiny EAGLE-3 plans (tests/corpus/valid/tiny-eagle3.json: fc over
3·H_t = 576 columns, draft vocabulary 600 of 1000 mapped by d2t; page size 1 with N 4, and page
size 4 with N 8), `peerprep` writes the contract files, `specplan run --device cpu` computes
specplan's outputs, and the peer's check must pass; with the window deliberately off by one,
or the RoPE frequencies permuted, it must fail, and for EAGLE-3 with d2t off by one, the final
norm left out, the 2H input concatenated in the wrong order, or the three target-layer blocks
of fc's columns rotated.
Finally the `run` command (checks and bench of an EAGLE-1 and an EAGLE-3 plan) and the report.

  PYTHONPATH=/path/to/torch python3 tests/peer/cpu_selftest.py [--bin DIR]

DIR holds `specplan` and `peerprep` (default: target/gpu-bundle/bin, then target/release).
"""
import argparse
import ast
import glob
import inspect
import math
import os
import subprocess
import sys
import tempfile
import types
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import flashinfer_peer as peer  # noqa: E402


def real_signatures():
    """Signatures of the wheel's BatchPrefillWithPagedKVCacheWrapper methods (from its source)."""
    wheels = glob.glob(os.path.join(ROOT, ".whl", "flashinfer_python-*.whl"))
    if not wheels:
        sys.exit("no FlashInfer wheel in .whl/ (run tests/peer/prepare_wheels.py .whl)")
    with zipfile.ZipFile(wheels[0]) as z:
        src = z.read("flashinfer/prefill.py").decode()
    cls = next(
        n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "BatchPrefillWithPagedKVCacheWrapper"
    )
    sigs = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in ("__init__", "plan", "run"):
            continue
        a = fn.args
        params = []
        pos = a.posonlyargs + a.args
        defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
        for arg, d in zip(pos, defaults):
            kw = {} if d is None else {"default": _literal(d)}
            params.append(inspect.Parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, **kw))
        if a.vararg:
            params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
        for arg, d in zip(a.kwonlyargs, a.kw_defaults):
            kw = {} if d is None else {"default": _literal(d)}
            params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, **kw))
        sigs[fn.name] = inspect.Signature(params)  # the last `run` (the implementation) wins
    return sigs


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def fake_flashinfer(sigs):
    class Wrapper:
        def __init__(self, *args, **kwargs):
            b = sigs["__init__"].bind(self, *args, **kwargs)
            b.apply_defaults()
            a = b.arguments
            assert a["kv_layout"] == "NHD", a["kv_layout"]
            assert a["backend"] == "fa2", a["backend"]
            self.graph = a["use_cuda_graph"]
            if self.graph:
                for k in ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"):
                    assert torch.is_tensor(a[k]), f"{k} must be a tensor in CUDA graph mode"
                self.fixed_b = len(a["qo_indptr_buf"]) - 1
                assert len(a["paged_kv_indptr_buf"]) == self.fixed_b + 1
                assert len(a["paged_kv_last_page_len_buf"]) == self.fixed_b
            self.a = a
            self.max_rows = None

        def plan(self, *args, **kwargs):
            b = sigs["plan"].bind(self, *args, **kwargs)
            b.apply_defaults()
            a = b.arguments
            qo = a["qo_indptr"].to("cpu")
            bs = len(qo) - 1
            assert a["causal"] is True
            assert a["custom_mask"] is None and a["packed_custom_mask"] is None
            q_dt = a["q_data_type"]
            assert isinstance(q_dt, torch.dtype), q_dt
            if self.graph:
                assert bs == self.fixed_b, "batch size fixed under CUDA graphs"
                rows = int(qo[-1])
                self.max_rows = rows if self.max_rows is None else self.max_rows
                assert rows <= self.max_rows
                assert len(a["paged_kv_indices"]) <= len(self.a["paged_kv_indices_buf"])
                self.a["qo_indptr_buf"].copy_(a["qo_indptr"])
                self.a["paged_kv_indptr_buf"].copy_(a["paged_kv_indptr"])
                self.a["paged_kv_last_page_len_buf"].copy_(a["paged_kv_last_page_len"])
                self.a["paged_kv_indices_buf"][: len(a["paged_kv_indices"])].copy_(a["paged_kv_indices"])
            u = a["uniform_q_len"]
            if u is not None:
                assert bool(((qo[1:] - qo[:-1]) == u).all()), "uniform_q_len does not describe the batch"
            self.p = a

        def run(self, *args, **kwargs):
            b = sigs["run"].bind(self, *args, **kwargs)
            b.apply_defaults()
            a = b.arguments
            p = self.p
            q, (kc, vc), out = a["q"], a["paged_kv_cache"], a["out"]
            assert isinstance(a["paged_kv_cache"], tuple)
            assert q.dtype == p["q_data_type"] and kc.dtype == p["kv_data_type"]
            hq, hkv, d, ps = p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"], p["page_size"]
            assert kc.dim() == 4 and tuple(kc.shape[1:]) == (ps, hkv, d), f"NHD [pages, {ps}, {hkv}, {d}]: {tuple(kc.shape)}"
            assert kc.stride() == vc.stride()
            assert tuple(q.shape[1:]) == (hq, d)
            assert out is not None and out.shape == q.shape and out.dtype == q.dtype
            src = self.a if self.graph else p
            qo = (src["qo_indptr_buf"] if self.graph else p["qo_indptr"]).tolist()
            kvp = (src["paged_kv_indptr_buf"] if self.graph else p["paged_kv_indptr"]).tolist()
            idx = (src["paged_kv_indices_buf"] if self.graph else p["paged_kv_indices"]).tolist()
            last = (src["paged_kv_last_page_len_buf"] if self.graph else p["paged_kv_last_page_len"]).tolist()
            assert q.shape[0] == qo[-1]
            wl = p["window_left"]
            g = hq // hkv
            scale = 1.0 / math.sqrt(d) if p["sm_scale"] is None else p["sm_scale"]
            for i in range(len(qo) - 1):
                pages = idx[kvp[i] : kvp[i + 1]]
                kv_len = (len(pages) - 1) * ps + last[i] if pages else 0
                rows = [pages[k // ps] * ps + k % ps for k in range(kv_len)]
                K = kc.reshape(-1, hkv, d)[rows].float().repeat_interleave(g, 1)
                V = vc.reshape(-1, hkv, d)[rows].float().repeat_interleave(g, 1)
                Q = q[qo[i] : qo[i + 1]].float()
                qo_len = qo[i + 1] - qo[i]
                S = torch.einsum("qhd,khd->hqk", Q, K) * scale
                qq = torch.arange(qo_len)[:, None]
                kk = torch.arange(kv_len)[None, :]
                keep = kk + qo_len <= kv_len + qq  # bottom-right causal
                if wl >= 0:
                    keep &= kk + qo_len + wl >= kv_len + qq
                S = S.masked_fill(~keep[None], float("-inf"))
                out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(S, -1), V).to(out.dtype)
            return out

    m = types.ModuleType("flashinfer")
    m.BatchPrefillWithPagedKVCacheWrapper = Wrapper
    m.__version__ = "stand-in"
    return m


class ReplayGraph:
    def __init__(self, step, outs):
        self.step, self.outs = step, outs

    def replay(self):
        for o, n in zip(self.outs, self.step.forward()):
            o.copy_(n)


def cpu_capture(step):
    step.attn.plan()
    step.stage()
    outs = step.forward()
    return ReplayGraph(step, outs), outs, 0.0


def fake_cuda():
    """CUDA events, streams and graphs as no-ops (the bench path's Python runs; its times mean nothing)."""
    import contextlib

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, *a):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.001

    class Stream:
        def wait_stream(self, s):
            pass

    class Graph:
        def replay(self):
            pass

    c = torch.cuda
    c.Event, c.CUDAGraph = Event, Graph
    c.Stream = c.current_stream = lambda *a: Stream()
    c.stream = c.graph = lambda *a, **k: contextlib.nullcontext()
    c.synchronize = c.empty_cache = lambda *a: None


def sh(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin")
    a = ap.parse_args()
    bins = [a.bin] if a.bin else [os.path.join(ROOT, "target/gpu-bundle/bin"), os.path.join(ROOT, "target/release")]
    tool = {}
    for name in ("specplan", "peerprep"):
        tool[name] = next((os.path.join(d, name) for d in bins if os.path.exists(os.path.join(d, name))), None)
        if not tool[name]:
            sys.exit(f"no {name} binary in {bins}")
    fi = fake_flashinfer(real_signatures())
    peer.capture = cpu_capture
    # fp32 products of the bf16 operands: what torch.mm(out_dtype=float32) gives on CUDA.
    peer.logits_f32 = lambda h, w: h.float() @ w.float().t()
    dev = torch.device("cpu")
    work = tempfile.mkdtemp(prefix="peer-selftest-")
    e3 = ["--hf-config", os.path.join(ROOT, "tests/corpus/valid/tiny-eagle3.json"), "--speculative-eagle-topk", "4",
          "--speculative-num-steps", "3", "--max-context-len", "512"]
    variants = [
        ("tiny", ["--preset", "tiny"], 5, 45),
        ("tiny-swa16-hot256", ["--preset", "tiny", "--sliding-window", "16", "--hot-vocab-size", "256"], 6, 60),
        ("tiny-fp16-page1", ["--preset", "tiny", "--dtype", "fp16", "--page-size", "1"], 3, 40),
        ("tiny-eagle3", e3 + ["--speculative-num-draft-tokens", "4", "--buckets", "1,2,4"], 4, 60),
        ("tiny-eagle3-page4-n8", e3 + ["--speculative-num-draft-tokens", "8", "--buckets", "1,3,6", "--page-size", "4"],
         5, 90),
    ]
    failures = 0

    def report(label, c):
        print(
            f"{label}: {'ok' if c['ok'] else 'MISMATCH'}  "
            f"hidden rel peer/specplan {c['hidden_rel_peer_vs_specplan']:.2e}, "
            f"peer/f32 {c['hidden_rel_peer_vs_f32']:.2e}, specplan/f32 {c['hidden_rel_specplan_vs_f32']:.2e}; "
            f"probs |Δ| {c['prob_abs_max']:.2e} (rel {c['prob_rel_max']:.2e}, p ≤ {c['prob_ref_max']:.3g}); "
            f"ids {c['ids_equal']}/{c['ids_total']} ({c['ids_tied']} ties, {c['ids_mismatch']} mismatched); "
            f"kv rel {c['kv_rel_peer_vs_specplan']:.2e}"
        )

    def negative(label, P, W, d, ref, model=None):
        """A deliberately wrong peer (plan facts, weights or the model class altered) must fail the check."""
        orig = peer.Model
        peer.Model = model or orig
        try:
            c = peer.run_check(fi, P, "wrong", W, os.path.join(d, "inputs.safetensors"), ref, d, dev)
        finally:
            peer.Model = orig
        first = c["failures"][0] if c["failures"] else ""
        print(f"{label} (wrong): {'caught' if not c['ok'] else 'NOT CAUGHT'}" + (f"  [{first}]" if first else ""))
        return c["ok"]

    for name, flags, b, maxp in variants:
        d = os.path.join(work, name)
        os.makedirs(d)
        plan = os.path.join(d, "p.plan")
        sh(tool["specplan"], "compile", *flags, "--no-kernels", "-o", plan)
        sh(tool["peerprep"], "contract-files", plan, d, "--batch", str(b), "--max-prefix", str(maxp))
        ref = os.path.join(d, "specplan.safetensors")
        sh(tool["specplan"], "run", "--plan", plan, "--weights", f"{d}/weights.safetensors",
           "--inputs", f"{d}/inputs.safetensors", "--out", ref, "--device", "cpu")
        P = peer.load_plan(os.path.join(d, "plan.json"))
        W = peer.st_load(os.path.join(d, "weights.safetensors"))
        c = peer.run_check(fi, P, name, W, os.path.join(d, "inputs.safetensors"), ref, d, dev)
        report(f"{name} [{P['head']}, hidden_in {P['hidden_in']}, lm rows {P['lm_vocab']}]", c)
        for f in c["failures"]:
            print("    " + f)
        failures += not c["ok"]
        # The random bench weights carry peerprep's names and shapes and load into the same model.
        R = peer.random_weights(P, dev, seed=1)
        got = {k: tuple(v.shape) for k, v in R.items()}
        want = {k: tuple(v.shape) for k, v in W.items()}
        if got != want:
            print(f"{name}: random_weights differ from peerprep's: {sorted(set(got.items()) ^ set(want.items()))}")
            failures += 1
        peer.Model(P, R, dev)
        if "swa" in name:
            # Sensitivity: a window off by one must be caught.
            orig = peer.window_left
            peer.window_left = lambda w: -1 if w is None else int(w)
            failures += negative(f"{name} with window_left = W", P, W, d, ref)
            peer.window_left = orig
        if name in ("tiny", "tiny-eagle3"):
            # Sensitivity: wrong RoPE frequencies (halves of inv_freq swapped) must be caught.
            inv = P["inv_freq"]
            P2 = dict(P, inv_freq=inv[len(inv) // 2 :] + inv[: len(inv) // 2])
            failures += negative(f"{name} with RoPE frequencies permuted", P2, W, d, ref)
        if P["head"] == "eagle3":
            assert P["hidden_in"] == 3 * P["target_hidden"] != P["hidden"] and P["draft_vocab"] < P["vocab"], P
            # d2t off by one (kept inside the target vocabulary): the ids must mismatch.
            d2t = W["d2t"].clone()
            one = torch.where(torch.arange(len(d2t)) + d2t + 1 < P["vocab"], 1, -1)
            failures += negative(f"{name} with d2t off by one", P, dict(W, d2t=d2t + one), d, ref)
            # lm_head over the pre-norm rows (the final norm left out).
            class NoFinalNorm(peer.Model):
                def __init__(self, *a):
                    super().__init__(*a)
                    self.final_norm = None

            failures += negative(f"{name} without the final norm", P, W, d, ref, model=NoFinalNorm)
            # norm(h) ‖ norm(embed) instead of norm(embed) ‖ norm(h): the same as q/k/v_proj's two
            # column halves swapped.
            qkv = {f"midlayer.self_attn.{x}_proj.weight": W[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"}
            H = P["hidden"]
            failures += negative(f"{name} with the 2H input concatenated hidden first", P,
                                 dict(W, **{k: torch.cat([v[:, H:], v[:, :H]], 1) for k, v in qkv.items()}), d, ref)
            # The three target layers' features in the wrong order (fc's column blocks rotated).
            fc, ht = W["fc.weight"], P["target_hidden"]
            failures += negative(f"{name} with fc's 3 target-layer blocks rotated", P,
                                 dict(W, **{"fc.weight": torch.cat([fc[:, ht:], fc[:, :ht]], 1)}), d, ref)
    # The whole `run` command (checks, bench, JSON) and the report over its JSON.
    fake_cuda()
    os.environ["PEER_DEVICE"] = "cpu"
    peer.import_flashinfer = lambda: fi
    # One process per model as .ci/gpu-bench runs it; the plans are named like the benchmark's
    # EAGLE-1 / EAGLE-3 pair (both N 4) so the report's comparison of the two has rows.
    runs = [
        ("llama3-8b-eagle-n4", os.path.join(work, "tiny-swa16-hot256")),
        ("llama3.1-8b-eagle3-n4", os.path.join(work, "tiny-eagle3")),
    ]
    peer_jsons = []
    for pname, d in runs:
        out_json = os.path.join(work, f"{pname}.peer.json")
        peer_jsons.append(out_json)
        sys.argv = [
            "flashinfer_peer.py", "run", "--plan", pname, f"{d}/plan.json", "--weights", f"{d}/weights.safetensors",
            "--check", pname, f"{d}/inputs.safetensors", f"{d}/specplan.safetensors",
            "--bench", "--batches", "1,3", "--prefixes", "20,5000", "--runs", "3", "--warmup", "1", "--json", out_json,
        ]
        rc = peer.main()
        doc = peer.json.load(open(out_json))
        heads = sorted({r.get("head") for r in doc["rows"]})
        print(f"run {pname}: exit {rc}, {len(doc['checks'])} check(s) "
              f"({'ok' if doc['checks'] and all(c['ok'] for c in doc['checks']) else 'FAILED'}), "
              f"{len(doc['rows'])} bench rows (heads {heads}), errors {doc['errors']}")
        failures += rc != 0 or len(doc["rows"]) != 2 or not doc["checks"] or bool(doc["errors"])
    spec = os.path.join(work, "specbench.json")
    with open(spec, "w") as f:
        f.write('[{"copy_bytes_per_s":4e12,"bf16_flops_per_s":7e14}')
        for pname, us in (("llama3-8b-eagle-n4", 110), ("llama3.1-8b-eagle3-n4", 90)):
            for bb in (1, 3):
                f.write(f',\n{{"plan":"{pname}","batch":{bb},"prefix":20,"prep_us":9,"replay_us":{us - 10},'
                        f'"full_us":{us},"eager_us":120,"floor_us":50,"attn_us":10,"attn_tb_s":0.1}}')
        f.write("]\n")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "report.py"), "--specbench", spec, "--peer", *peer_jsons, "--out", work],
        capture_output=True, text=True,
    )
    print("report:", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr)
    failures += r.returncode != 0
    md = open(os.path.join(work, "report.md")).read()
    rows = peer.json.load(open(os.path.join(work, "report.json")))["rows"]
    e3_rows = [x for x in rows
               if x["model"] == "llama3.1-8b-eagle3" and x.get("peer_step_us") and x.get("specplan_step_us")]
    has_cmp = "EAGLE-3 draft head vs EAGLE-1" in md
    print(f"report: {len(e3_rows)} EAGLE-3 rows with specplan and peer times; EAGLE-3 vs EAGLE-1 section "
          f"{'present' if has_cmp else 'MISSING'}")
    failures += len(e3_rows) != 2 or not has_cmp

    # The safetensors writer round-trips.
    t = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7), "c": torch.zeros(0, 4)}
    path = os.path.join(work, "rt.safetensors")
    peer.st_save(path, t)
    back = peer.st_load(path)
    assert all(torch.equal(t[k], back[k]) for k in t), "st_save/st_load round trip"
    print(f"safetensors round trip ok; files under {work}")
    print("selftest:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
