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
    slots of steps 0..i. Host indptr [R + 1] int32, device indices int32."""
    dev = table.device
    lens = [l + i + 1 for l in prefix for _ in range(k)]
    indptr = torch.tensor([0] + list(fp._cumsum(lens)), dtype=torch.int32)
    parts = []
    for z in range(len(lens)):
        r = z // k
        parts.append(table[req[r], : prefix[r]])
        parts.append(loc[: i + 1, z])
    indices = torch.cat(parts).to(torch.int32).to(dev)
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
