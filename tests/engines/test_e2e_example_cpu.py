"""The end-to-end greedy EAGLE example (python/examples/eagle_e2e.py) on CPU tensors, with a
plan that has both draft phases: specplan's draft-extend and its draft-decode chain on the
example's PyTorch draft pools and req_to_token, against the example's own PyTorch draft. The
example checks the generated tokens against the target's greedy decoding, and in its forced
run both draft-extends and both chains on the same state each step (ids equal outside near
ties, K/V and hidden rows within 1e-2); it exits 1 when a check fails. Runs wherever torch is
installed (the engines' environments); skipped elsewhere. On the GPU the example runs in
`.ci/gpu python`, with the chain in PyTorch until the phase's device step exists.
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here (.ci/engines installs it)")

import specplan  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples", "eagle_e2e.py")


def test_both_draft_phases_reproduce_the_targets_greedy_tokens(tmp_path):
    plan = specplan.Plan.compile(preset="tiny", speculative_eagle_topk=1, speculative_num_steps=3,
                                 speculative_num_draft_tokens=4, draft_decode_steps="3", page_size=1,
                                 max_context_len=256, buckets=[1, 2, 4, 8], no_kernels=True)
    path = tmp_path / "e2e.plan"
    plan.save(path)
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, EXAMPLE, str(path), "--device", "cpu", "--batch", "1", "3", "--steps", "8",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    reports = json.loads(out.read_text())
    for rep in reports:
        assert rep["real"]["chain"] == "specplan" and rep["real"]["tokens_match_target"], rep["real"]
        f = rep["forced"]
        assert f["steps"] == 8 and f["chain_id_bad"] == 0 and f["chain_kv_rel"] <= 1e-2, f
        assert f["id_bad"] == 0 and f["kv_rel"] <= 1e-2, f
