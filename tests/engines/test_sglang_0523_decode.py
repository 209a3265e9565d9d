"""specplan's draft-decode slot against SGLang 0.5.23's own code: the release's
`prepare_for_draft` builds the draft-decode batch (lane slots gathered from `req_to_token`,
positions, `num_tokens_per_req`) and hands it to `EagleDraftWorker.cuda_graph_runner` as
`EagleDraftWorker.draft` does (eagle_worker_v2.py:660-715); the reference is the release's
`EagleDraftWorker.draft_forward` (the hot-token map, `select_top_k_tokens`, the model
forward of its `LlamaForCausalLMEagle[3]` classes, the logits processor, `fast_topk`,
`organize_draft_results`) on the same batch. The tree (parent_list, top_scores_index,
draft_tokens) must be the release's for every request but one whose score list has a near
tie at a cut, and the lanes' K/V within bf16 tolerance; no other cache slot changes.

Replaced in the reference, as CUDA-only: SGLang's draft-decode attention backends (FlashInfer
/ Triton / FA3 multi-step backends; `draft_attn_backend.attn_backends[i]`) by `LaneAttention`
below, which computes what they compute (each lane's row at step i attends the request's
prefix and its own lane's slots of steps 0..i, eagle_worker_common.py:275-333 and
`generate_draft_decode_kv_indices`), and the Triton kernel `assign_draft_cache_locs_contiguous`
(kernels/ops/speculative/cache_locs.py:42-82) by the same gather in torch. The tree build
after the slot (`build_eagle_verify_input`) is a CUDA kernel and is not run.
"""

import os
import types

import pytest

sglang = pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed here (.ci/engines installs it)")

import sglang_env as env  # noqa: E402
import torch  # noqa: E402

import specplan  # noqa: E402
import specplan.sglang as sp_sglang  # noqa: E402

DEVICE = os.environ.get("SPECPLAN_ENGINES_DEVICE", "cpu")
CTX = 160
# A near tie between SGLang's bf16 eager forward and specplan's f32 one: probabilities
# within 10% (about 0.1 in logits, a few bf16 roundings of a logit near 5).
TIE = 0.1

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="draft decode on CUDA tensors is not built yet (CPU only)")


def _assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_cols,
                             positions=None, mrope=None):
    """The Triton kernel's gather in torch: request r's topk·num_cols slots from
    req_to_token[row, seq_lens[r]:], and the positions when asked."""
    n = topk * num_cols
    for r, (row, L) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[r * n:(r + 1) * n] = req_to_token[row, L:L + n].to(out_cache_loc.dtype)
        if positions is not None:
            positions[r] = L


class LaneAttention:
    """Step `step` of SGLang's draft-decode attention: row z = r·K + k writes its K/V at the
    step's `out_cache_loc[z]` and attends the prefix `req_to_token[row_r, :L_r]` plus lane k's
    slots of steps 0..step (`locs[j, z]`)."""

    def __init__(self, pool, r2t, rows, seq_lens, locs, topk, step):
        self.pool, self.r2t, self.rows, self.L = pool, r2t, rows, seq_lens
        self.locs, self.k, self.step = locs, topk, step

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        loc = forward_batch.out_cache_loc
        if save_kv_cache:
            self.pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
        kb = self.pool.get_key_buffer(layer.layer_id)
        vb = self.pool.get_value_buffer(layer.layer_id)
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        hk = layer.tp_k_head_num
        qz = q.reshape(-1, hq, d).float()
        out = torch.empty_like(qz)
        for z in range(qz.shape[0]):
            r = z // self.k
            slots = torch.cat([self.r2t.req_to_token[self.rows[r], :self.L[r]].long(),
                               self.locs[: self.step + 1, z].long()])
            kk = env.slot_kv_of(kb, self.pool, slots).float().repeat_interleave(hq // hk, dim=1)
            vv = env.slot_kv_of(vb, self.pool, slots).float().repeat_interleave(hq // hk, dim=1)
            s = torch.einsum("hd,thd->ht", qz[z], kk) * layer.scaling
            out[z] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vv)
        return out.to(q.dtype).reshape(q.shape[0], hq * d)


class Case:
    """A draft head, SGLang's pools and worker, a plan with the draft-decode phase, and one
    draft-decode batch (prefixes, rows and draft-extend's outputs: fresh random values)."""

    def __init__(self, *, eagle3, topk, steps, ndraft, page_size=1, draft_vocab=None, L=(5, 19, 3, 40),
                 tiers=None, seed=0, lm_scale=6.0):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.eagle3, self.topk, self.steps, self.n, self.page = eagle3, topk, steps, ndraft, page_size
        env.publish_args(algo="EAGLE3" if eagle3 else "EAGLE", steps=steps, topk=topk, ndraft=ndraft,
                         page_size=page_size, device=DEVICE)
        path = env.write_config(eagle3=eagle3, ctx=CTX, draft_vocab=draft_vocab, bias=not eagle3)
        self.mc = env.model_config(path, eagle3=eagle3)
        self.model = env.build_model(self.mc, eagle3=eagle3, device=DEVICE, seed=seed)
        with torch.no_grad():
            # Peaked distributions: a tree whose cuts are well apart in most requests.
            self.model.lm_head.weight.mul_(lm_scale)
        cfg = self.mc.hf_config
        self.h, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.head_vocab = draft_vocab or self.vocab
        # SGLang's own switch to its torch move of K/V (move_kv_cache_native) for the prefix
        # tail prepare_for_draft copies into each lane's first page (pages with topk > 1):
        # the default path is a Triton kernel.
        old = os.environ.get("SGLANG_NATIVE_MOVE_KV_CACHE")
        os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"
        try:
            self.r2t, self.kv = env.make_pools(max_reqs=16, ctx=CTX, kv_heads=cfg.num_key_value_heads,
                                              head_dim=cfg.head_dim, dtype=self.mc.dtype, page_size=page_size,
                                              device=DEVICE)
        finally:
            if old is None:
                del os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"]
            else:
                os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = old
        algo = SpeculativeAlgorithm.EAGLE3 if eagle3 else SpeculativeAlgorithm.EAGLE
        self.dr = env.draft_runner(self.mc, self.r2t, self.kv, model=self.model, page_size=page_size, algo=algo,
                                   device=DEVICE)
        hot = getattr(self.model, "hot_token_id", None)
        if eagle3 and draft_vocab is not None:
            g = torch.Generator().manual_seed(seed + 1)
            hot = torch.randperm(self.vocab, generator=g)[:draft_vocab].sort().values.to(DEVICE)
        self.hot = hot
        self.worker = env.draft_worker(self.dr, self.r2t, topk=topk, steps=steps, ndraft=ndraft, algo=algo,
                                       hot_token_id=hot, device=DEVICE)
        self.worker.index_share_for_mtp_iteration = False
        self.L = list(L)
        self.plan = specplan.Plan.compile(
            hf_config=os.path.join(path, "config.json"), speculative_eagle_topk=topk, speculative_num_steps=steps,
            speculative_num_draft_tokens=ndraft, page_size=page_size, max_context_len=CTX, buckets=[1, 2, 4, 8],
            outputs="topk-draft,logits", no_kernels=True, draft_decode_steps=tiers or str(steps),
        )
        self.rows = list(range(1, len(self.L) + 1))
        g = torch.Generator().manual_seed(seed + 9)
        # Whole pages of a shuffled order per request, as SGLang's allocator hands them out,
        # covering the lanes' reach past the prefix.
        reach = [sp_sglang._decode_reach(l, steps, topk, page_size) for l in self.L]
        pages = [(l + r + page_size - 1) // page_size for l, r in zip(self.L, reach)]
        order = torch.randperm(sum(pages), generator=g) + 1
        at = 0
        for row, l, r, np_ in zip(self.rows, self.L, reach, pages):
            pg = order[at:at + np_]
            at += np_
            slots = (pg[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[: l + r]
            self.r2t.req_to_token[row, : l + r] = slots.to(torch.int32)
        env.fill_prefix(self.kv, self.r2t, self.rows, self.L)
        self.kv0 = [(k.clone(), v.clone()) for k, v in zip(self.kv.k_buffer, self.kv.v_buffer)]
        bs = len(self.L)
        p = torch.rand(bs, topk, generator=g) * 0.9 + 0.05
        self.topk_p = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values.float()
        self.topk_index = torch.stack([torch.randperm(self.head_vocab, generator=g)[:topk] for _ in range(bs)])
        self.hidden = torch.randn(bs, self.h, generator=g).to(self.mc.dtype)

    def batch(self):
        """The ScheduleBatch `EagleDraftWorker.draft` hands `prepare_for_draft`."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        bs = len(self.L)
        seq = torch.tensor(self.L, dtype=torch.int64)
        di = EagleDraftInput(topk_p=self.topk_p.clone(), topk_index=self.topk_index.clone(),
                             hidden_states=self.hidden.clone())
        b = ScheduleBatch(
            reqs=[env._Req(i) for i in range(bs)], req_to_token_pool=self.r2t, model_config=self.mc, device=DEVICE,
            forward_mode=ForwardMode.DECODE, spec_algorithm=SpeculativeAlgorithm.EAGLE,
            input_ids=torch.zeros(bs, dtype=torch.int64), req_pool_indices=torch.tensor(self.rows, dtype=torch.int64),
            seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=int(sum(self.L)), out_cache_loc=None,
            multimodal_inputs=[None] * bs, sampling_info=None, return_logprob=False, spec_info=di,
        )
        b.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=self.page)
        return b, di

    def restore(self):
        for (k, v), (k0, v0) in zip(zip(self.kv.k_buffer, self.kv.v_buffer), self.kv0):
            k.copy_(k0)
            v.copy_(v0)

    def run(self, runner, monkeypatch, seen=None):
        """The release's prepare_for_draft with `runner` in the slot, then the slot's
        execute (or, with no runner, the release's draft_forward on LaneAttention; `seen`
        then gathers each forward's logits and the tree's score list, read by a spy that
        changes nothing)."""
        from sglang.srt.speculative import eagle_worker_common as wc
        from sglang.srt.speculative import eagle_worker_v2 as w2
        from sglang.srt.speculative.eagle_utils import organize_draft_results

        monkeypatch.setattr(wc, "assign_draft_cache_locs_contiguous_func", _assign_draft_cache_locs)
        if seen is not None:
            def organize(score_list, token_list, parents_list, n):
                seen["scores"] = torch.cat(score_list, dim=1).flatten(1)
                return organize_draft_results(score_list, token_list, parents_list, n)

            forward = self.dr.forward

            def logits(fb, *a, **k):
                out = forward(fb, *a, **k)
                seen.setdefault("logits", []).append(out.logits_output.next_token_logits.float().clone())
                return out

            monkeypatch.setattr(w2, "organize_draft_results", organize)
            monkeypatch.setattr(self.dr, "forward", logits)
        self.restore()
        batch, di = self.batch()
        fb, can_run, _ = wc.prepare_for_draft(di, self.r2t, batch, runner, self.dr, self.topk, self.steps)
        locs = fb.out_cache_loc.view(len(self.L), self.topk, self.steps).permute(2, 0, 1).reshape(self.steps, -1)
        # What prepare_for_draft itself wrote (with pages and topk > 1, each lane's copy of
        # the prefix tail) is the baseline of the slots the draft leaves alone.
        self.prepared = [(k.clone(), v.clone()) for k, v in zip(self.kv.k_buffer, self.kv.v_buffer)]
        with torch.no_grad():
            if runner is not None:
                assert can_run, "the slot serves the batch"
                out = runner.execute(fb)
            else:
                self.worker.draft_attn_backend = types.SimpleNamespace(attn_backends=[
                    LaneAttention(self.kv, self.r2t, self.rows, self.L, locs, self.topk, i)
                    for i in range(self.steps)
                ])
                out = self.worker.draft_forward(fb)
        written = locs[: self.steps - 1].reshape(-1)
        k, v = env.slot_kv(self.kv, written)
        return [t.clone() if t is not None else None for t in out], (k.clone(), v.clone()), written


def lane_gap(logits, r, k):
    """The smallest relative gap between neighbours among the K + 1 most likely tokens of
    request r's lanes, over every forward: a near tie there reorders a lane's children (or
    swaps its K-th child) without showing in the score list."""
    m = float("inf")
    for step in logits:
        p = torch.softmax(step[r * k:(r + 1) * k].double(), dim=-1)
        top = p.topk(min(k + 1, p.shape[-1]), dim=-1).values
        m = min(m, float(((top[:, :-1] - top[:, 1:]) / top[:, :-1]).min()))
    return m


def min_cut_gap(scores, k, steps, nodes):
    """The smallest relative gap of one request's score list at a cut the tree makes (each
    step's K of K², the N − 1 of all)."""
    def gap(v, n):
        if n >= v.numel():
            return float("inf")
        s = v.double().sort(descending=True).values
        return float((s[n - 1] - s[n]).abs() / s[n - 1].abs().clamp_min(1e-30))

    m = gap(scores, nodes)
    for i in range(1, steps):
        m = min(m, gap(scores[k + (i - 1) * k * k: k + i * k * k], k))
    return m


CASES = {
    "eagle1-chain-topk1": dict(eagle3=False, topk=1, steps=3, ndraft=4),
    "eagle1-tree-topk4-n8": dict(eagle3=False, topk=4, steps=3, ndraft=8),
    "eagle1-tree-topk2-steps5-page4": dict(eagle3=False, topk=2, steps=5, ndraft=6, page_size=4),
    "eagle3-chain-topk1-d2t96": dict(eagle3=True, topk=1, steps=3, ndraft=4, draft_vocab=96),
    "eagle3-tree-topk4-fullvocab": dict(eagle3=True, topk=4, steps=3, ndraft=8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_slot_returns_the_releases_tree(name, monkeypatch):
    c = Case(**CASES[name])
    seen = {}
    want, (wk, wv), written = c.run(None, monkeypatch, seen=seen)
    monkeypatch.undo()
    slot = sp_sglang.install(c.worker, c.plan)
    assert set(slot.decode) == {c.steps}
    assert c.worker.cuda_graph_runner is slot.decode[c.steps]
    assert c.worker.cuda_graph_runner.captured_req_width == c.topk
    got, (gk, gv), _ = c.run(c.worker.cuda_graph_runner, monkeypatch)
    before = c.prepared
    assert got[3] is None and want[3] is None, "no draft probabilities without rejection sampling"
    for g, w, what in zip(got[:3], want[:3], ("parent_list", "top_scores_index", "draft_tokens")):
        assert g.dtype == torch.int64 and tuple(g.shape) == tuple(w.shape), f"{what}: {g.dtype} {tuple(g.shape)}"
    bs, nodes = len(c.L), c.n - 1
    ties, equal = 0, []
    for r in range(bs):
        same = all(torch.equal(g[r], w[r]) for g, w in zip(got[:3], want[:3]))
        equal.append(same)
        if not same:
            # Chains (topk 1) have no score list: SGLang returns before organize_draft_results.
            gap = lane_gap(seen["logits"], r, c.topk)
            if "scores" in seen:
                gap = min(gap, min_cut_gap(seen["scores"][r], c.topk, c.steps, nodes))
            assert gap < TIE, (f"{name}: request {r}'s tree differs from the release's without a near tie (gap {gap:.3g}): "
                               f"{[t[r].tolist() for t in got[:3]]} vs {[t[r].tolist() for t in want[:3]]}")
            ties += 1
    assert ties <= 1, f"{name}: {ties} of {bs} trees differ (near ties)"
    # The lanes' K/V of every request whose tree is the release's.
    per = (c.steps - 1) * c.topk
    for r in range(bs):
        if equal[r]:
            rows = slice(r * c.topk, (r + 1) * c.topk)
            sel = torch.cat([torch.arange(j * bs * c.topk, (j + 1) * bs * c.topk)[rows] for j in range(c.steps - 1)])
            for a, b_, what in ((gk, wk, "K"), (gv, wv, "V")):
                x, y = a[sel].float(), b_[sel].float()
                assert (x - y).abs().max() <= 3e-2 * (1 + y.abs().max()), f"{name}: request {r}'s lane {what}"
    assert per * bs == written.numel()
    # No other slot changed.
    k, v = c.kv.k_buffer[0], c.kv.v_buffer[0]
    mask = torch.ones(k.shape[0] if k.dim() == 3 else k.shape[0] * k.shape[2], dtype=torch.bool)
    mask[written.long()] = False
    for now, old in ((k, before[0][0]), (v, before[0][1])):
        if now.dim() == 3:
            assert torch.equal(now[mask], old[mask]), f"{name}: a slot outside the lanes changed"
        else:
            idx = mask.nonzero().flatten()
            assert torch.equal(env.slot_kv_of(now, c.kv, idx), env.slot_kv_of(old, c.kv, idx))


def test_can_run_graph_follows_sglangs_gates(monkeypatch):
    c = Case(eagle3=False, topk=4, steps=3, ndraft=8, L=(3, 4, 5))
    slot = sp_sglang.install(c.worker, c.plan).decode[3]
    from sglang.srt.speculative import eagle_worker_common as wc

    monkeypatch.setattr(wc, "assign_draft_cache_locs_contiguous_func", _assign_draft_cache_locs)
    batch, di = c.batch()
    fb, can_run, _ = wc.prepare_for_draft(di, c.r2t, batch, slot, c.dr, c.topk, c.steps)
    assert can_run
    fb.spec_info.num_tokens_per_req = c.topk + 1
    assert not slot.can_run_graph(fb), "another width"
    fb.spec_info.num_tokens_per_req = c.topk
    fb.seq_lens_cpu = torch.tensor([3, 4, CTX - 2])
    assert not slot.can_run_graph(fb), "a request whose lanes pass max_context_len"
    fb.seq_lens_cpu = None
    fb.spec_info.hidden_states = fb.spec_info.hidden_states.float()
    assert not slot.can_run_graph(fb), "hidden states of another dtype"
    fb.spec_info.hidden_states = fb.spec_info.hidden_states.to(c.mc.dtype)
    assert slot.can_run_graph(fb)
    slot._dp = True
    assert not slot.can_run_graph(fb)


def test_a_refused_request_is_logged_and_gets_a_zero_tree(monkeypatch, caplog):
    import logging

    c = Case(eagle3=False, topk=2, steps=3, ndraft=4, L=(5, 9, 3))
    slot = sp_sglang.install(c.worker, c.plan)
    good, _, _ = c.run(c.worker.cuda_graph_runner, monkeypatch)
    # Request 1's row points its first lane slot at request 0's prefix slot 0.
    c.r2t.req_to_token[c.rows[1], c.L[1]] = c.r2t.req_to_token[c.rows[0], 0]
    with caplog.at_level(logging.ERROR, logger="sglang.srt.speculative.specplan"):
        got, _, _ = c.run(c.worker.cuda_graph_runner, monkeypatch)
    assert any("specplan draft-decode" in m and "request 0" in m for m in caplog.messages), caplog.messages
    e = slot.decode[3].runner.last_error()
    assert e is not None and e.request == 0 and e.other == 1, e
    assert all(int(t[0].abs().sum()) == 0 for t in got[:3]), "the refused request's tree is zeros"
    assert all(torch.equal(g[2], w[2]) for g, w in zip(got[:3], good[:3])), "request 2 is unaffected"


def test_install_sets_every_adaptive_tier_the_plan_has():
    c = Case(eagle3=False, topk=1, steps=3, ndraft=4, tiers="2,3,5")
    states = {s: types.SimpleNamespace(speculative_num_steps=s, speculative_num_draft_tokens=s + 1,
                                       cuda_graph_runner="sglang's", cuda_graph_runner_for_draft_extend="sglang's")
              for s in (1, 2, 3, 5, 7)}
    eagle = types.SimpleNamespace(draft_worker=c.worker, adaptive_controller=types.SimpleNamespace(_states=states))
    slot = sp_sglang.install(eagle, c.plan)
    assert sorted(slot.decode) == [2, 3, 5]
    for s in (2, 3, 5):
        assert states[s].cuda_graph_runner is slot.decode[s] and slot.decode[s].steps == s
    assert states[1].cuda_graph_runner == states[7].cuda_graph_runner == "sglang's", "tiers the plan lacks keep SGLang's"
    assert c.worker.cuda_graph_runner is slot.decode[3]
    assert slot.decode[5].runner.num_draft_tokens == 6
    no = sp_sglang.install(c.worker, c.plan, decode=False)
    assert no.decode == {}
