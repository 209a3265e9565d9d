"""The draft-decode peer: SGLang 0.5.23's `draft_forward` (srt/speculative/eagle_worker_v2.py:
742-923) in PyTorch + FlashInfer, as SGLang runs it with its FlashInfer backend and its
draft-decode CUDA graph (eagle_draft_cuda_graph_runner.py):

- per step i, outside the graph (SGLang's `init_forward_metadata_out_graph`): each lane row's
  KV indices — the request's prefix slots, then its lane's slots of steps 0..i
  (`generate_draft_decode_kv_indices`, page size 1) — built on the device from the table,
  and FlashInfer's plan() on the host;
- in one graph: the S − 1 forwards of b·K rows (RoPE at L + i, K/V at the lane's slot of
  step i), each followed by the per-lane softmax top-K (ids mapped to target ids) and
  SGLang's selection (`select_top_k_tokens`: the K best of the K² path scores, torch.topk),
  then `organize_draft_results` (the N − 1 best of the score list, sorted).

Page size 1 (SGLang's default; with pages and topk > 1 SGLang also copies each lane's prefix
tail, not modelled here). The attention is FlashInfer's fa2 BatchPrefillWithPagedKVCacheWrapper
in CUDA-graph mode with one query row per lane (causal with qo_len 1: every key), one wrapper
per step. The layers, head and weights are flashinfer_peer's (the draft-extend peer's).

Inputs as the phase's signature: topk_probs [b, K] f32, topk_ids [b, K] target ids, hidden
[b, H], prefixes L (host ints), table [rows, cols] token slots (int64, page 1), req rows.
"""
import torch
import torch.nn.functional as F

import flashinfer_peer as fp


def lane_slots(table, req, prefix, k, steps):
    """Token slots [S − 1, b·K] of each lane row at each step: lane k's forward i at position
    L + k·S + i (page size 1)."""
    dev = table.device
    b = len(prefix)
    L = torch.tensor(prefix, dtype=torch.int64, device=dev)
    lane = torch.arange(k, device=dev)
    out = []
    for i in range(steps - 1):
        pos = (L[:, None] + lane[None, :] * steps + i).reshape(-1)
        rows = req.repeat_interleave(k)
        out.append(table[rows, pos])
    return torch.stack(out) if out else torch.empty(0, b * k, dtype=torch.int64, device=dev)


def step_indices(table, req, prefix, k, loc, i):
    """FlashInfer's index arrays of step i: per lane row, the prefix slots then the lane's
    slots of steps 0..i (one gather on the device, as SGLang's
    generate_draft_decode_kv_indices). Host indptr [R + 1] int32, device indices int32."""
    dev = table.device
    r = len(prefix) * k
    L = torch.tensor(prefix, dtype=torch.int64).repeat_interleave(k)  # per row, host
    lens = L + i + 1
    indptr = torch.zeros(r + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    Ld, lensd = L.to(dev), lens.to(dev)
    total = int(indptr[-1])
    row = torch.repeat_interleave(torch.arange(r, device=dev), lensd)
    off = torch.arange(total, device=dev) - torch.repeat_interleave(indptr[:-1].to(dev).long(), lensd)
    lrow = Ld[row]
    prefix_slot = table[req.repeat_interleave(k)[row], off.clamp(max=table.shape[1] - 1)]
    lane_slot = loc[(off - lrow).clamp(min=0, max=i), row]
    indices = torch.where(off < lrow, prefix_slot, lane_slot).to(torch.int32)
    return indptr, indices


class DecodeAttention:
    """One FlashInfer wrapper per step, CUDA-graph mode, fixed buffers for R = b·K rows."""

    def __init__(self, flashinfer, P, rows, steps, max_keys, workspace, dev):
        self.P, self.rows = P, rows
        self.qo_indptr = torch.arange(rows + 1, dtype=torch.int32)
        self.wrappers = [
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty(rows + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.empty(rows + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.empty(max_keys, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.empty(rows, dtype=torch.int32, device=dev),
                backend="fa2",
            )
            for _ in range(max(steps - 1, 0))
        ]
        self.layouts = []
        self.step = 0

    def set_layouts(self, layouts):
        self.layouts = layouts

    def plan(self):
        P = self.P
        ones = torch.ones(self.rows, dtype=torch.int32)
        for w, (indptr, indices) in zip(self.wrappers, self.layouts):
            w.plan(
                self.qo_indptr,
                indptr,
                indices,
                ones,
                P["heads"],
                P["kv_heads"],
                P["head_dim"],
                1,
                causal=True,
                window_left=-1,
                q_data_type=P["act"],
                kv_data_type=P["act"],
                uniform_q_len=1,
            )

    def run(self, layer, q, k_cache, v_cache, out):
        return self.wrappers[self.step].run(q, (k_cache, v_cache), out=out)


class DecodeStep:
    """Static buffers of one batch size and SGLang's draft loop over them (graph-capturable
    once `attn` is planned)."""

    def __init__(self, model, attn, k_cache, v_cache, b, k, steps, n, dev):
        P = model.P
        self.m, self.attn, self.kc, self.vc = model, attn, k_cache, v_cache
        self.b, self.k, self.steps, self.n = b, k, steps, n
        r = b * k
        self.topk_p = torch.zeros(b, k, dtype=torch.float32, device=dev)
        self.topk_ids = torch.zeros(b, k, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(b, P["hidden"], dtype=P["act"], device=dev)
        self.pos0 = torch.zeros(r, dtype=torch.int64, device=dev)
        self.loc = torch.zeros(max(steps - 1, 1), r, dtype=torch.int64, device=dev)
        self.attn_out = torch.empty(r, P["heads"], P["head_dim"], dtype=P["act"], device=dev)

    def set_inputs(self, topk_p, topk_ids, hidden, prefix, table, req):
        """Copies the step's inputs into the static buffers and builds every step's indices
        (the metadata work SGLang does before its replay)."""
        k, s = self.k, self.steps
        self.topk_p.copy_(topk_p)
        self.topk_ids.copy_(topk_ids)
        self.hidden.copy_(hidden)
        self.pos0.copy_(torch.tensor(prefix, dtype=torch.int64).repeat_interleave(k))
        loc = lane_slots(table, req, prefix, k, s)
        if s > 1:
            self.loc.copy_(loc)
        self.attn.set_layouts([step_indices(table, req, prefix, k, loc, i) for i in range(s - 1)])

    def stage(self):
        """Inputs are in the static buffers once `set_inputs` ran (flashinfer_peer.capture's
        hook)."""

    def forward(self):
        """(parent_list [b, (S−1)K + 1], top_scores_index [b, N − 1], draft_tokens [b, N − 1],
        score_list [b, K + (S−1)K²])."""
        m, b, k, s = self.m, self.b, self.k, self.steps
        dev = self.topk_p.device
        scores = self.topk_p  # [b, K]
        ids = self.topk_ids.reshape(-1)  # lane tokens, target ids
        hidden = self.hidden.repeat_interleave(k, dim=0)  # [R, H]
        score_list = [self.topk_p]
        token_list = [self.topk_ids]
        parents = [torch.arange(-1, k, device=dev, dtype=torch.int64).expand(b, k + 1)]
        for i in range(s - 1):
            self.attn.step = i
            if m.eagle3:
                x, first = hidden, fp.eagle3_first(m, ids, hidden)
            else:
                x, first = F.linear(torch.cat([m.embed[ids], hidden], -1), m.fc_w, m.fc_b), None
            x = fp.layers_forward(m, x, first, self.pos0 + i, self.loc[i], self.attn.run, self.kc, self.vc,
                                  self.attn_out)
            p, c, _ = fp.head_topk(m, x)  # [R, K] each
            # Selection i + 1: path scores of the K² children, the K best become the lanes.
            expand = (scores[:, :, None] * p.view(b, k, k)).reshape(b, k * k)
            cand = c.view(b, k * k)
            score_list.append(expand)
            token_list.append(cand)
            top, sel = torch.topk(expand, k, dim=-1)
            if i + 1 < s - 1:
                parents.append(sel + k * k * i + k)
            scores = top
            ids = torch.gather(cand, 1, sel).reshape(-1)
            src = (torch.arange(b, device=dev)[:, None] * k + sel // k).reshape(-1)
            hidden = x.index_select(0, src)
        sl = torch.cat(score_list, dim=1)
        tl = torch.cat(token_list, dim=1)
        top_index = torch.sort(torch.topk(sl, self.n - 1, dim=-1)[1], dim=-1).values
        draft = torch.gather(tl, 1, top_index)
        parent_list = torch.cat(parents, dim=1)
        return parent_list, top_index, draft, sl


def bench_decode(fi, m, P, B, L, k, steps, n, runs, warmup, ws, dev, seed, flush=None, name=None):
    """One (B, L) of a tier: every request at prefix L over scattered token slots. The step
    (input copies, the lanes' indices, plan() of every step's wrapper, the replay; host wall
    clock until done) and the replay alone (CUDA events, L2 flushed before each run), medians
    of `runs` after `warmup`."""
    import time

    hkv, D, layers, dt = P["kv_heads"], P["head_dim"], P["layers"], P["act"]
    per = L + (k - 1) * steps + steps - 1
    slots = B * per + 1
    gen = torch.Generator()
    gen.manual_seed(seed)
    kc = [torch.empty(slots, 1, hkv, D, dtype=dt, device=dev).uniform_(-1.0, 1.0) for _ in range(layers)]
    vc = [torch.empty(slots, 1, hkv, D, dtype=dt, device=dev).uniform_(-1.0, 1.0) for _ in range(layers)]
    table = torch.randperm(slots - 1, generator=gen)[: B * per].view(B, per).to(dev)
    req = torch.arange(B, device=dev)
    attn = DecodeAttention(fi, P, B * k, steps, B * k * (L + steps), ws, dev)
    step = DecodeStep(m, attn, kc, vc, B, k, steps, n, dev)
    p = torch.rand(B, k, generator=gen) * 0.9 + 0.05
    topk_p = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values.to(dev)
    topk_ids = torch.randint(0, P["vocab"], (B, k), generator=gen).to(dev)
    hidden = torch.empty(B, P["hidden"], dtype=dt, device=dev).uniform_(-1.0, 1.0)
    prefix = [L] * B
    step.set_inputs(topk_p, topk_ids, hidden, prefix, table, req)
    graph, outs, capture_ms = fp.capture(step)
    walls, preps = [], []
    for it in range(warmup + runs):
        t0 = time.perf_counter()
        step.set_inputs(topk_p, topk_ids, hidden, prefix, table, req)
        attn.plan()
        t1 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if it >= warmup:
            walls.append((t2 - t0) * 1e6)
            preps.append((t1 - t0) * 1e6)
    replay = fp.replay_median(graph, runs, warmup, flush)
    row = {
        "plan": name or P.get("name"),
        "phase": f"draft_decode:{steps}",
        "batch": B,
        "prefix": L,
        "topk": k,
        "steps": steps,
        "draft_tokens": n,
        "prep_us": round(fp.median(preps), 2),
        "step_us": round(fp.median(walls), 1),
        "replay_us": round(replay, 1),
        "graph_capture_ms": round(capture_ms, 1),
        "runs": runs,
        "warmup": warmup,
    }
    del graph, outs, step, attn, kc, vc
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    """decode_peer.py bench --plan-json P.json --name NAME --steps S --draft-tokens N
    [--batches 1,8,32,64] [--prefixes 1024,4096] [--runs 100] [--warmup 10] [--seed 1]
    [--with-extend] --json OUT.json (NAME: the plan file's stem, as specbench names its rows)"""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["bench"])
    ap.add_argument("--plan-json", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--draft-tokens", type=int, required=True)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prefixes", default="1024,4096")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--l2-flush-mb", type=int, default=256)
    ap.add_argument("--json", required=True)
    ap.add_argument("--with-extend", action="store_true",
                    help="also time the draft-extend peer step at each (B, L), for the whole draft per step")
    a = ap.parse_args()
    P = fp.load_plan(a.plan_json)
    if P["page_size"] != 1:
        raise SystemExit(f"{a.plan_json}: page size {P['page_size']}; the draft-decode peer models page size 1")
    fi = fp.import_flashinfer()
    dev = fp.device()
    m = fp.Model(P, fp.random_weights(P, dev, a.seed), dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush = torch.empty(a.l2_flush_mb << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    rows, extend = [], []
    for B in (int(x) for x in a.batches.split(",")):
        for L in (int(x) for x in a.prefixes.split(",")):
            if L + (P["topk"] - 1) * a.steps + a.steps - 1 > P["max_context_len"]:
                continue
            rows.append(bench_decode(fi, m, P, B, L, P["topk"], a.steps, a.draft_tokens, a.runs, a.warmup, ws, dev,
                                     a.seed + B + L, flush, a.name))
            fp.log(f"decode B={B} L={L}: step {rows[-1]['step_us']} µs (prep {rows[-1]['prep_us']}), "
                   f"replay {rows[-1]['replay_us']} µs")
            # The same step's draft-extend forward (N rows per request at prefix L), as the
            # draft-extend benchmark's peer times it: the draft's two forwards of one step.
            if a.with_extend and L + P["num_draft_tokens"] <= P["max_context_len"]:
                extend.append(fp.bench_shape(fi, m, P, a.name, B, L, a.runs, a.warmup, ws, dev, a.seed + 7 * B + L,
                                             flush))
                fp.log(f"extend B={B} L={L}: step {extend[-1]['step_us']} µs, replay {extend[-1]['replay_us']} µs")
            with open(a.json, "w") as f:
                json.dump({"decode": rows, "extend": extend}, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
