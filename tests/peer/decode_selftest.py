#!/usr/bin/env python3
"""Self-test of the draft-decode peer (decode_peer.py) without a GPU (needs torch and the
specplan wheel; not run by CI): FlashInfer replaced by cpu_selftest's stand-in (its methods
bound against the real signatures read from the wheel in .whl/, attention computed in fp32
from FlashInfer's documented semantics), the graph by running the forward. On tiny plans
(topk 4 with S 3 and N 8; topk 2 with S 5 and N 6; the chain topk 1, S 3; EAGLE-3 with a
d2t map, topk 4), the same weights, pools, table and inputs go through the peer and through
specplan's CPU engine (`engine.draft_decode()` on the same torch tensors): the trees must
agree for every request but at most one per case (a near tie between the peer's bf16 torch
and specplan's f32), and the lanes' K/V of the agreeing requests within 2e-2 relative. With
the lane slots deliberately shifted by one, or the selection's parents off by one lane, it
must fail.

  python3 tests/peer/decode_selftest.py [--bin DIR]      (DIR holds peerprep; default
                                                          target/release, then target/debug)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import cpu_selftest  # noqa: E402
import decode_peer as dp  # noqa: E402
import flashinfer_peer as fp  # noqa: E402

import specplan  # noqa: E402


def plan_facts(plan, bindir, tmp):
    path = os.path.join(tmp, "p.plan")
    plan.save(path)
    out = subprocess.run([os.path.join(bindir, "peerprep"), "plan-json", path], check=True, capture_output=True,
                         text=True).stdout
    j = os.path.join(tmp, "p.json")
    with open(j, "w") as f:
        f.write(out)
    return fp.load_plan(j)


def one_case(fi, bindir, tmp, *, topk, steps, n, eagle3=False, seed=0, break_slots=False, break_parents=False):
    flags = dict(speculative_eagle_topk=topk, speculative_num_steps=steps, speculative_num_draft_tokens=n,
                 draft_decode_steps=str(steps), page_size=1, max_context_len=256, buckets=[1, 2, 4, 8],
                 no_kernels=True)
    if eagle3:
        plan = specplan.Plan.compile(hf_config=os.path.join(ROOT, "tests/corpus/valid/tiny-eagle3.json"), **flags)
    else:
        plan = specplan.Plan.compile(preset="tiny", **flags)
    P = plan_facts(plan, bindir, tmp)
    dev = torch.device("cpu")
    W = fp.random_weights(P, dev, seed)
    m = fp.Model(P, W, dev)
    g = torch.Generator().manual_seed(seed + 3)
    b, act = 6, P["act"]
    hkv, d, layers = P["kv_heads"], P["head_dim"], P["layers"]
    prefix = [int(x) for x in torch.randint(1, 60, (b,), generator=g)]
    reach = (topk - 1) * steps + steps - 1
    slots = b * 128 + 8
    perm = torch.randperm(slots, generator=g)
    table = torch.full((b + 2, 128), -1, dtype=torch.int64)
    req = torch.randperm(b + 2, generator=g)[:b]
    for i in range(b):
        table[req[i], : prefix[i] + reach] = perm[i * 128 : i * 128 + prefix[i] + reach]
    kc0 = [torch.randn(slots, 1, hkv, d, generator=g).to(act) for _ in range(layers)]
    vc0 = [torch.randn(slots, 1, hkv, d, generator=g).to(act) for _ in range(layers)]
    p = torch.rand(b, topk, generator=g) * 0.9 + 0.05
    topk_p = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values.float()
    vocab = P["vocab"]
    topk_ids = torch.stack([torch.randperm(vocab, generator=g)[:topk] for _ in range(b)])
    hidden = torch.randn(b, P["hidden"], generator=g).to(act)

    # The peer.
    kc, vc = [t.clone() for t in kc0], [t.clone() for t in vc0]
    attn = dp.DecodeAttention(fi, P, b * topk, steps, b * topk * (128 + steps), torch.empty(1 << 20, dtype=torch.uint8),
                              dev)
    step = dp.DecodeStep(m, attn, kc, vc, b, topk, steps, n, dev)
    t_in = table
    if break_slots:  # every lane writes one position later than SGLang's slot
        t_in = torch.cat([table[:, 1:], table[:, -1:]], 1)
    step.set_inputs(topk_p, topk_ids, hidden, prefix, t_in, req)
    attn.plan()
    if break_parents:
        orig = torch.topk

        def topk_shift(x, kk, dim=-1, **kw):
            v, i = orig(x, kk, dim=dim, **kw)
            if x.shape[-1] == topk * topk and topk > 1:
                i = (i + topk) % (topk * topk)  # the same child of the next lane
                v = torch.gather(x, -1, i)
            return v, i

        torch.topk = topk_shift
        try:
            got = step.forward()
        finally:
            torch.topk = orig
    else:
        got = step.forward()

    # specplan's CPU engine on copies of the same memory (token pools [slots, H, D]).
    ks, vs = [t.clone().view(slots, hkv, d) for t in kc0], [t.clone().view(slots, hkv, d) for t in vc0]
    eng = specplan.Engine(plan, {k: v for k, v in W.items()}, ks, vs, req_to_token=table.to(torch.int32))
    out = eng.draft_decode().run(topk_p, topk_ids, hidden, req, torch.tensor(prefix))
    assert eng.last_error() is None, eng.last_error()
    pw, nodes = (steps - 1) * topk + 1, n - 1
    differ, kv_bad = 0, []
    loc = dp.lane_slots(table, req, prefix, topk, steps)
    for r in range(b):
        same = (torch.equal(got[0][r], out.parent_list[r]) and torch.equal(got[1][r], out.top_scores_index[r])
                and torch.equal(got[2][r], out.draft_tokens[r]))
        if not same:
            differ += 1
            continue
        z = loc[:, r * topk:(r + 1) * topk].reshape(-1)
        for a, c in zip(kc + vc, ks + vs):
            x, y = a.view(slots, hkv, d)[z].float(), c[z].float()
            rel = float((x - y).norm() / y.norm().clamp_min(1e-30))
            if rel > 2e-2:
                kv_bad.append((r, rel))
    return differ, kv_bad, b, (pw, nodes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    args = ap.parse_args()
    bindir = args.bin or next(
        (d for d in (os.path.join(ROOT, "target/release"), os.path.join(ROOT, "target/debug"))
         if os.path.exists(os.path.join(d, "peerprep"))), None)
    if bindir is None:
        sys.exit("no peerprep binary (cargo build -p specplan-tests --bin peerprep)")
    fi = cpu_selftest.fake_flashinfer(cpu_selftest.real_signatures())
    # fp32 products of the bf16 operands: what torch.mm(out_dtype=float32) gives on CUDA.
    fp.logits_f32 = lambda h, w: h.float() @ w.float().t()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            ("tree topk 4, S 3, N 8", dict(topk=4, steps=3, n=8)),
            ("tree topk 2, S 5, N 6", dict(topk=2, steps=5, n=6)),
            ("chain topk 1, S 3", dict(topk=1, steps=3, n=4)),
            ("EAGLE-3 d2t, topk 4, S 3, N 8", dict(topk=4, steps=3, n=8, eagle3=True)),
        ]
        for name, kw in cases:
            differ, kv_bad, b, _ = one_case(fi, bindir, tmp, **kw)
            good = differ <= 1 and not kv_bad
            ok &= good
            print(f"{name:<32} trees equal {b - differ}/{b}, lane K/V over bound {kv_bad[:3]}  "
                  f"{'ok' if good else 'FAIL'}")
        for name, kw in [("slots shifted (must fail)", dict(topk=4, steps=3, n=8, break_slots=True)),
                         ("parents off a lane (must fail)", dict(topk=4, steps=3, n=8, break_parents=True))]:
            differ, kv_bad, b, _ = one_case(fi, bindir, tmp, **kw)
            caught = differ > 1 or bool(kv_bad)
            ok &= caught
            print(f"{name:<32} trees equal {b - differ}/{b}, K/V over bound {len(kv_bad)}  "
                  f"{'caught' if caught else 'NOT CAUGHT'}")
        # The bench path (CUDA graphs and events stood in for; its times mean nothing).
        fp.capture = cpu_selftest.cpu_capture
        cpu_selftest.fake_cuda()
        plan = specplan.Plan.compile(preset="tiny", speculative_eagle_topk=4, speculative_num_steps=3,
                                     speculative_num_draft_tokens=8, draft_decode_steps="3", page_size=1,
                                     max_context_len=256, no_kernels=True)
        P = plan_facts(plan, bindir, tmp)
        dev = torch.device("cpu")
        m = fp.Model(P, fp.random_weights(P, dev, 5), dev)
        row = dp.bench_decode(fi, m, P, 2, 40, 4, 3, 8, 2, 1, torch.empty(1 << 20, dtype=torch.uint8), dev, 0)
        want = {"phase", "batch", "prefix", "prep_us", "step_us", "replay_us", "steps", "draft_tokens"}
        good = want <= set(row) and row["phase"] == "draft_decode:3" and row["batch"] == 2
        ok &= good
        print(f"bench path: {sorted(row)}  {'ok' if good else 'FAIL'}")
    print("decode peer self-test:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
