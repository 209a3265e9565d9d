#!/usr/bin/env python3
"""The peer: specplan's draft-extend forward (docs/semantics.md) in PyTorch + FlashInfer, as an engine
runs it today. FlashInfer's fa2 BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True) with
uniform_q_len = N does the attention; everything else is torch; the whole forward is one CUDA
graph; the wrapper's plan() runs on the host before every replay and is part of the step.

The forward is docs/semantics.md (compiled by compiler/src/lower.rs, run by runtime/src/cpu/):
  x = fc(embed(ids) ‖ hidden) + fc.bias
  per layer l: h = x (l = 0: EAGLE's identity input norm) or RMSNorm(x);
    q, k, v = h·Wqkvᵀ; q, k = RoPE (rotate-half, angle = f32(pos · inv_freq), the plan's
    inv_freq); K/V written at positions prefix_i + j through the page table; causal attention
    over prefix_i + N keys (sliding window W: keys in (p − W, p]); x += o·Woᵀ;
    x += down(silu(gate(RMSNorm(x))) · up(RMSNorm(x)))
  hidden_out_i = x[i·N + accept_i − 1] (no final norm); logits = hidden_out · lm_headᵀ in fp32
  (FR-Spec: the hot rows); probs = softmax; top-K (FR-Spec: ids mapped through hot_token_ids).
An EAGLE-3 head (plan fact head = "eagle3"; shared/domain/eagle3-and-draft-decode.md §1.1),
one layer (`midlayer.*`):
  h = fc(hidden) (fc.weight [H, 3·H_t], hidden rows hidden_in = 3·H_t wide);
  a = RMSNorm_in(embed(ids)) ‖ RMSNorm_hidden(h) [2H]; q, k, v = a·Wqkvᵀ (K-dim 2H), RoPE,
    K/V and attention as above; x = h + o·Woᵀ; x += MLP(RMSNorm(x)) as above;
  hidden_out_i = x[i·N + accept_i − 1] (PRE-norm); logits = RMSNorm_final(hidden_out) ·
  lm_headᵀ in fp32 (lm_head [V_d, H]); probs = softmax over V_d; top-K draft ids d map to
  target ids d + d2t[d].
Dimensions, eps, inv_freq (bit-exact), windows, N, top-K, page size, FR-Spec and the head
kind come from the plan's facts (`peerprep plan-json PLAN`), never from defaults.

  flashinfer_peer.py warmup --plan-json P.json [...]
      import FlashInfer and build (JIT) the fa2 modules the plans need.
  flashinfer_peer.py run --plan NAME P.json [--plan ...] --json OUT.json
      [--weights W.safetensors --check NAME INPUTS.safetensors SPECPLAN_OUT.safetensors ...]
      [--bench [--batches 1,8,32,64] [--prefixes 1024,4096] [--runs 100] [--warmup 10]]
      check: the `specplan run` contract files (`peerprep`), through the peer's graph, against
        specplan's outputs and against an fp32 torch reference; exit 1 on a mismatch.
      bench: random weights (generated on the GPU), every request at prefix L, page size from
        the plan with pages dealt in random order; per (B, L): one captured graph; the step
        (input copies + plan() + replay, host wall clock until done), the replay alone (CUDA
        events) and FlashInfer's attention alone (run() only, captured, plan() outside), each
        a median of --runs after --warmup; as in specbench, the replay and the attention are
        timed with L2 flushed before each run (--l2-flush-mb), the step is not.

FlashInfer travels as wheels (shared/domain/flashinfer.md §5; tests/peer/prepare_wheels.py).
`.ci/gpu bench` installs them, runs this script and the report (tests/peer/report.py).
Results are rewritten after every check and shape, so a crash keeps what was measured.
Exit codes: 0 ok, 1 a check failed, 2 errors in some part, 3 FlashInfer unusable.
"""
import argparse
import json
import math
import os
import struct
import sys
import time
import traceback

import torch
import torch.nn.functional as F

# Bounds of the equal-output check (peer vs specplan, both bf16 pipelines; vs fp32 reference).
HIDDEN_REL_PEER_SPEC = 2e-2  # per request, relative RMS
HIDDEN_REL_F32 = 1e-2  # each implementation against the fp32 reference
KV_REL = 2e-2  # written cache rows, per layer, relative RMS
PROB_ABS = 2e-3  # top-K probabilities: |Δ| ≤ max(min(PROB_ABS, PROB_REL·p + 1e-5), PROB_LOGIT·p)
PROB_REL = 5e-2
# A logit difference of 0.02 moves p by about 0.02·p: what two bf16 pipelines differ by at the
# logit scale of the check's weights (std ≈ 2.3; hidden rows differing by ~4e-3 relative).
# It only matters above p = PROB_ABS / PROB_LOGIT = 0.1, where the absolute cap alone is
# tighter than bf16 (peaked rows: EAGLE-3's small draft vocabularies, the tiny plans).
PROB_LOGIT = 2e-2


def prob_bound(p):
    """The allowed |Δ| of a top-K probability p (a float or a tensor: the larger of the two sides)."""
    if torch.is_tensor(p):
        return torch.maximum(torch.clamp(PROB_REL * p + 1e-5, max=PROB_ABS), PROB_LOGIT * p)
    return max(min(PROB_ABS, PROB_REL * p + 1e-5), PROB_LOGIT * p)


def log(*a):
    print("[peer]", *a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Plan facts and safetensors files (own reader/writer: a u64 header length, a JSON header,
# raw little-endian data; no dependency beyond torch).

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
_ST = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
}
_ST_NAME = {v: k for k, v in _ST.items()}


def f32_from_bits(bits):
    return list(struct.unpack("<%df" % len(bits), struct.pack("<%dI" % len(bits), *bits)))


def load_plan(path):
    with open(path) as f:
        p = json.load(f)
    p["inv_freq"] = f32_from_bits(p["rope_inv_freq_bits"])
    # YaRN's / LongRoPE's attention factor on cos and sin (plans from before it: 1).
    p["rope_scale"] = f32_from_bits([p.get("rope_scale_bits", 0x3F800000)])[0]
    p["eps"] = f32_from_bits([p["rms_norm_eps_bits"]])[0]
    p["act"] = DTYPES[p["dtype"]]
    if len(p["inv_freq"]) * 2 != p["head_dim"]:
        raise ValueError(f"{path}: {len(p['inv_freq'])} inv_freq values for head_dim {p['head_dim']}")
    # Plans from before EAGLE-3 carry no head facts: EAGLE-1, input rows H wide.
    p["head"] = p.get("head") or "eagle1"
    if p["head"] not in ("eagle1", "eagle3"):
        raise ValueError(f"{path}: head {p['head']!r} (the peer computes eagle1 and eagle3)")
    if p.get("hidden_in") is None:
        p["hidden_in"] = 3 * p["target_hidden"] if p["head"] == "eagle3" else p["hidden"]
    p["draft_vocab"] = p.get("draft_vocab")
    if p["head"] == "eagle3" and p.get("hot_vocab_size"):
        raise ValueError(f"{path}: an EAGLE-3 head with FR-Spec hot rows (d2t and hot_token_ids are exclusive)")
    if p["head"] == "eagle3" and p["layers"] != 1:
        raise ValueError(f"{path}: an EAGLE-3 head with {p['layers']} layers (the peer computes one midlayer)")
    # Rows of lm_head as the forward uses it: FR-Spec's hot rows, the draft vocabulary, or V.
    p["lm_vocab"] = p.get("hot_vocab_size") or p["draft_vocab"] or p["vocab"]
    return p


def window_left(w):
    # specplan: a row at position p sees keys in (p − W, p]; FlashInfer keeps key k for query
    # row q iff k ≥ (kv_len − qo_len + q) − window_left, i.e. window_left = W − 1.
    return -1 if w is None else int(w) - 1


def st_load(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = os.path.getsize(path) - 8 - n
        buf = bytearray(size)
        got = f.readinto(buf)
    if got != size:
        raise IOError(f"{path}: read {got} of {size} data bytes")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST[info["dtype"]]
        start, end = info["data_offsets"]
        shape = list(info["shape"])
        numel = math.prod(shape)
        if numel * torch.empty((), dtype=dt).element_size() != end - start:
            raise IOError(f"{path}: {name}: {end - start} bytes for shape {shape} {info['dtype']}")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(buf, dtype=dt, count=numel, offset=start).reshape(shape)
    return out


def st_save(path, tensors):
    header, chunks, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The model: weights under Hugging Face names, packed once (QKV and gate/up concatenated,
# FR-Spec hot rows gathered), as an engine loads them.

_MM_OUT_DTYPE = None


def logits_f32(h, w):
    """h·wᵀ with fp32 output from bf16 operands (as specplan's lm_head GEMM writes fp32)."""
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE is None:
        try:
            a = torch.ones(2, 8, dtype=h.dtype, device=h.device)
            r = torch.mm(a, a.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = r.dtype == torch.float32
        except (TypeError, RuntimeError) as e:
            log(f"WARNING: torch.mm(out_dtype=float32) unavailable ({e}); logits rounded to {h.dtype}")
            _MM_OUT_DTYPE = False
    if _MM_OUT_DTYPE:
        return torch.mm(h, w.t(), out_dtype=torch.float32)
    return torch.mm(h, w.t()).float()


_HAS_RMS = hasattr(F, "rms_norm")


def rms_norm(x, w, eps):
    if _HAS_RMS:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class Model:
    """Weights of one head, packed as an engine packs them. EAGLE-1/2: `layers.L.*`, fc over
    embed ‖ hidden [H, 2H]. EAGLE-3 (P["head"] == "eagle3"): `midlayer.*` (layer 0), fc over
    the target's features [H, 3·H_t], the two input norms, the final `norm.weight`, lm_head
    over the draft vocabulary and `d2t` (draft id d → target id d + d2t[d])."""

    def __init__(self, P, W, dev):
        self.P = P
        self.eps = P["eps"]
        self.eagle3 = P["head"] == "eagle3"
        H = P["hidden"]
        self.embed = W["embed_tokens.weight"]
        self.fc_w = W["fc.weight"]
        self.fc_b = W["fc.bias"] if P["fc_bias"] else None
        if not P["fc_bias"] and "fc.bias" in W:
            raise ValueError("fc.bias given, but the plan has no fc bias")
        self.layers = []
        for l in range(P["layers"]):
            p = "midlayer." if self.eagle3 else f"layers.{l}."
            self.layers.append(
                {
                    # EAGLE-1 layer 0 has no input norm; EAGLE-3's layer 0 norms its two inputs.
                    "in_norm": W[p + "input_layernorm.weight"] if l > 0 else None,
                    "emb_norm": W[p + "input_layernorm.weight"] if self.eagle3 else None,
                    "hidden_norm": W[p + "hidden_norm.weight"] if self.eagle3 else None,
                    "qkv": torch.cat([W[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).contiguous(),
                    "o": W[p + "self_attn.o_proj.weight"],
                    "post_norm": W[p + "post_attention_layernorm.weight"],
                    "gate_up": torch.cat([W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"]]).contiguous(),
                    "down": W[p + "mlp.down_proj.weight"],
                }
            )
        self.final_norm = W["norm.weight"] if self.eagle3 else None
        lm = W["lm_head.weight"]
        # id_map: column of lm/probs -> target id (None: the identity).
        self.hot_ids, self.d2t, self.id_map = None, None, None
        if P.get("hot_vocab_size"):
            self.hot_ids = W["hot_token_ids"].to(dev).long()
            lm = lm[self.hot_ids].contiguous()
            self.id_map = self.hot_ids
        elif self.eagle3 and P["draft_vocab"] is not None:
            self.d2t = W["d2t"].to(dev).long()
            if tuple(self.d2t.shape) != (P["draft_vocab"],):
                raise ValueError(f"d2t: shape {tuple(self.d2t.shape)}, the plan says ({P['draft_vocab']},)")
            self.id_map = torch.arange(P["draft_vocab"], device=dev, dtype=torch.int64) + self.d2t
            bad = ((self.id_map < 0) | (self.id_map >= P["vocab"])).nonzero()
            if bad.numel():
                d = int(bad[0, 0])
                raise ValueError(f"d2t[{d}] maps draft id {d} to {int(self.id_map[d])}, outside [0, {P['vocab']})")
        self.lm = lm
        self.inv_freq = torch.tensor(P["inv_freq"], dtype=torch.float32, device=dev)
        want = {
            "embed": (P["vocab"], H),
            "fc_w": (H, P["hidden_in"] if self.eagle3 else 2 * H),
            "lm": (P["lm_vocab"], H),
        }
        for k, s in want.items():
            if tuple(getattr(self, k).shape) != s:
                raise ValueError(f"{k}: shape {tuple(getattr(self, k).shape)}, the plan says {s}")
        qkv_k = 2 * H if self.eagle3 else H
        if self.layers[0]["qkv"].shape[1] != qkv_k:
            raise ValueError(f"layer 0 q/k/v_proj: {self.layers[0]['qkv'].shape[1]} columns, the plan says {qkv_k}")
        # Bytes of the weights every step reads whole (the embedding is gathered by row).
        mats = [self.fc_w, self.lm] + [w[k] for w in self.layers for k in ("qkv", "o", "gate_up", "down")]
        self.gemm_weight_bytes = sum(t.numel() * t.element_size() for t in mats)


def random_weights(P, dev, seed):
    """Random weights under Hugging Face names (the distributions of peerprep/gpucheck)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    dt = P["act"]
    H, I, V, D = P["hidden"], P["intermediate"], P["vocab"], P["head_dim"]
    hq, hkv = P["heads"], P["kv_heads"]
    e3 = P["head"] == "eagle3"
    hin = P["hidden_in"] if e3 else 2 * H  # fc's input width
    qk = 2 * H if e3 else H  # layer 0's q/k/v input width

    def u(shape, scale, base=0.0):
        t = torch.empty(shape, dtype=torch.float32, device=dev).uniform_(-1.0, 1.0, generator=g)
        return (t * scale + base).to(dt)

    W = {
        "embed_tokens.weight": u((V, H), 1.0),
        "fc.weight": u((H, hin), 1.0 / math.sqrt(hin)),
        "lm_head.weight": u((P["draft_vocab"] or V, H), 4.0 / math.sqrt(H)),
    }
    if P["fc_bias"]:
        W["fc.bias"] = u((H,), 0.1)
    for l in range(P["layers"]):
        p = "midlayer." if e3 else f"layers.{l}."
        k = qk if l == 0 else H
        if l > 0 or e3:
            W[p + "input_layernorm.weight"] = u((H,), 0.2, 1.0)
        if e3:
            W[p + "hidden_norm.weight"] = u((H,), 0.2, 1.0)
        W[p + "post_attention_layernorm.weight"] = u((H,), 0.2, 1.0)
        W[p + "self_attn.q_proj.weight"] = u((hq * D, k), 1.0 / math.sqrt(k))
        W[p + "self_attn.k_proj.weight"] = u((hkv * D, k), 1.0 / math.sqrt(k))
        W[p + "self_attn.v_proj.weight"] = u((hkv * D, k), 1.0 / math.sqrt(k))
        W[p + "self_attn.o_proj.weight"] = u((H, hq * D), 1.0 / math.sqrt(hq * D))
        W[p + "mlp.gate_proj.weight"] = u((I, H), 1.0 / math.sqrt(H))
        W[p + "mlp.up_proj.weight"] = u((I, H), 1.0 / math.sqrt(H))
        W[p + "mlp.down_proj.weight"] = u((H, I), 1.0 / math.sqrt(I))
    if e3:
        W["norm.weight"] = u((H,), 0.2, 1.0)
    if P.get("hot_vocab_size"):
        cpu = torch.Generator()
        cpu.manual_seed(seed)
        W["hot_token_ids"] = torch.randperm(V, generator=cpu)[: P["hot_vocab_size"]].to(dev)
    elif e3 and P["draft_vocab"] is not None:
        # The draft vocabulary: a sorted random subset of the target's; d2t = target − draft id.
        cpu = torch.Generator()
        cpu.manual_seed(seed + 1)
        used = torch.randperm(V, generator=cpu)[: P["draft_vocab"]].sort().values
        W["d2t"] = (used - torch.arange(P["draft_vocab"])).to(dev)
    return W


# ---------------------------------------------------------------------------------------------
# Paged layout of one step: FlashInfer's index arrays (host indptrs, device indices) and the
# per-row positions / cache slots / selected rows.


class Layout:
    def __init__(self, P, prefix, table, accept):
        """prefix: list[int]; table: CPU int64 [b, cols] page ids; accept: list[int]."""
        n, ps = P["num_draft_tokens"], P["page_size"]
        b = len(prefix)
        kv_len = [l + n for l in prefix]
        npages = [(k + ps - 1) // ps for k in kv_len]
        self.b, self.n = b, n
        self.kv_indptr = torch.tensor([0] + list(_cumsum(npages)), dtype=torch.int32)
        self.last_page_len = torch.tensor([(k - 1) % ps + 1 for k in kv_len], dtype=torch.int32)
        self.kv_indices = torch.cat([table[i, : npages[i]] for i in range(b)]).to(torch.int32)
        pos = torch.tensor([[l + j for j in range(n)] for l in prefix], dtype=torch.int64)
        page = torch.gather(table, 1, pos // ps)
        self.pos = pos.reshape(-1)
        self.loc = (page * ps + pos % ps).reshape(-1)
        self.sel = torch.tensor([i * n + min(max(a, 1), n) - 1 for i, a in enumerate(accept)], dtype=torch.int64)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


class Attention:
    """FlashInfer fa2 paged prefill in CUDA-graph mode for one batch size (one wrapper per
    distinct window): fixed index buffers, plan() on the host before every replay."""

    def __init__(self, flashinfer, P, b, max_pages, workspace, dev):
        self.P, self.b, self.n = P, b, P["num_draft_tokens"]
        self.qo_indptr = torch.arange(0, (b + 1) * self.n, self.n, dtype=torch.int32)
        self.wrappers = {}
        for wl in sorted({window_left(w) for w in P["windows"]}):
            self.wrappers[wl] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.empty(max_pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.empty(b, dtype=torch.int32, device=dev),
                backend="fa2",
            )

    def set_layout(self, lay, dev):
        self.kv_indptr = lay.kv_indptr
        self.last_page_len = lay.last_page_len
        self.kv_indices = lay.kv_indices.to(dev)  # device: plan() copies it device to device

    def plan(self):
        P = self.P
        for wl, w in self.wrappers.items():
            w.plan(
                self.qo_indptr,
                self.kv_indptr,
                self.kv_indices,
                self.last_page_len,
                P["heads"],
                P["kv_heads"],
                P["head_dim"],
                P["page_size"],
                causal=True,
                window_left=wl,
                q_data_type=P["act"],
                kv_data_type=P["act"],
                uniform_q_len=self.n,
            )

    def run(self, layer, q, k_cache, v_cache, out):
        return self.wrappers[window_left(self.P["windows"][layer])].run(q, (k_cache, v_cache), out=out)


class Step:
    """Static device buffers of one batch size and the forward over them (graph-capturable).
    Per-step inputs (ids, positions, cache slots, selected rows) travel as one pinned host
    buffer and one asynchronous copy; hidden states come from a device tensor."""

    def __init__(self, model, attn, k_cache, v_cache, b, dev):
        P = model.P
        self.m, self.attn, self.kc, self.vc = model, attn, k_cache, v_cache
        n = P["num_draft_tokens"]
        T = b * n
        self.b, self.n, self.T = b, n, T
        self.meta_host = torch.zeros(3 * T + b, dtype=torch.int64)
        if dev.type == "cuda":
            self.meta_host = self.meta_host.pin_memory()
        self.meta = torch.zeros(3 * T + b, dtype=torch.int64, device=dev)
        self.ids, self.pos = self.meta[:T], self.meta[T : 2 * T]
        self.loc, self.sel = self.meta[2 * T : 3 * T], self.meta[3 * T :]
        # The target's hidden rows: H wide (EAGLE-1), 3·H_t (EAGLE-3).
        self.hidden = torch.zeros(T, P["hidden_in"], dtype=P["act"], device=dev)
        self.hidden_src = None
        self.attn_out = torch.empty(T, P["heads"], P["head_dim"], dtype=P["act"], device=dev)

    def set_inputs(self, ids, lay, hidden_src):
        self.meta_host.copy_(torch.cat([ids.reshape(-1).long(), lay.pos, lay.loc, lay.sel]))
        self.hidden_src = hidden_src.reshape(self.T, -1)

    def stage(self):
        self.meta.copy_(self.meta_host, non_blocking=True)
        self.hidden.copy_(self.hidden_src, non_blocking=True)

    def forward(self):
        m = self.m
        first = None
        if m.eagle3:
            # h = fc(features) is layer 0's residual; its input is norm(embed) ‖ norm(h).
            x = F.linear(self.hidden, m.fc_w, m.fc_b)
            first = eagle3_first(m, self.ids, x)
        else:
            x = F.linear(torch.cat([m.embed[self.ids], self.hidden], -1), m.fc_w, m.fc_b)
        x = layers_forward(m, x, first, self.pos, self.loc, self.attn.run, self.kc, self.vc, self.attn_out)
        hs = x.index_select(0, self.sel)  # hidden_out: EAGLE-3's pre-norm rows too
        p, i, probs = head_topk(m, hs)
        return hs, p, i, probs


def eagle3_first(m, ids, x):
    """EAGLE-3's layer-0 input: norm(embed(ids)) ‖ hidden_norm(x) [2H]."""
    w0 = m.layers[0]
    return torch.cat([rms_norm(m.embed[ids], w0["emb_norm"], m.eps), rms_norm(x, w0["hidden_norm"], m.eps)], -1)


def layers_forward(m, x, first, pos, loc, attn_run, kcs, vcs, attn_out):
    """The head's decoder layers over rows x [T, H] (layer 0's residual) at positions `pos`,
    K/V written at token slots `loc`; `first` replaces layer 0's input (EAGLE-3), `attn_run(l,
    q, k_cache, v_cache, out)` is the attention. Returns the last residual rows."""
    P = m.P
    hq, hkv, D, T = P["heads"], P["kv_heads"], P["head_dim"], x.shape[0]
    half = D // 2
    ang = pos.float()[:, None] * m.inv_freq[None, :]
    cos, sin = ang.cos() * P["rope_scale"], ang.sin() * P["rope_scale"]
    c = torch.cat([cos, cos], -1)[:, None, :]
    s = torch.cat([-sin, sin], -1)[:, None, :]

    def rope(t):  # rotate-half in fp32: t·cos + rotate_half(t)·sin
        tf = t.float()
        return torch.addcmul(tf * c, torch.cat([tf[..., half:], tf[..., :half]], -1), s).to(t.dtype)

    for l, w in enumerate(m.layers):
        if l == 0 and first is not None:
            h = first
        else:
            h = x if w["in_norm"] is None else rms_norm(x, w["in_norm"], m.eps)
        qkv = F.linear(h, w["qkv"])
        q = rope(qkv[:, : hq * D].view(T, hq, D))
        k = rope(qkv[:, hq * D : (hq + hkv) * D].view(T, hkv, D))
        v = qkv[:, (hq + hkv) * D :].view(T, hkv, D)
        kc, vc = kcs[l], vcs[l]
        kc.view(-1, hkv, D)[loc] = k
        vc.view(-1, hkv, D)[loc] = v
        o = attn_run(l, q, kc, vc, attn_out)
        x = x + F.linear(o.view(T, hq * D), w["o"])
        gu = F.linear(rms_norm(x, w["post_norm"], m.eps), w["gate_up"])
        g, u = gu.chunk(2, dim=-1)
        x = x + F.linear(F.silu(g) * u, w["down"])
    return x


def head_topk(m, hs):
    """The head over hidden rows: (EAGLE-3: the final norm) lm_head in fp32, softmax, top-K with
    ids mapped to target ids (FR-Spec hot_token_ids[c], EAGLE-3 c + d2t[c]). Returns (p, ids,
    probs)."""
    lm_in = hs if m.final_norm is None else rms_norm(hs, m.final_norm, m.eps)
    probs = torch.softmax(logits_f32(lm_in, m.lm), dim=-1)
    p, i = torch.topk(probs, m.P["topk"], dim=-1)
    if m.id_map is not None:
        i = m.id_map[i]
    return p, i, probs


def capture(step):
    """Warm-up on a side stream (cuBLAS handles, lazy state), then one CUDA graph."""
    step.attn.plan()
    step.stage()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step.forward()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        outs = step.forward()
    torch.cuda.synchronize()
    return g, outs, (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------------------------------------
# fp32 reference from docs/semantics.md (dense masked attention per request), for the check.


@torch.no_grad()
def reference_f32(m, P, ids, hidden, prefix, accept, table, kc0, vc0, dev):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        n, ps, D = P["num_draft_tokens"], P["page_size"], P["head_dim"]
        hq, hkv = P["heads"], P["kv_heads"]
        G, half, b = hq // hkv, D // 2, len(prefix)
        T = b * n
        f = lambda t: t.float()  # noqa: E731
        kc, vc = f(kc0.to(dev)), f(vc0.to(dev))
        emb, hid = f(m.embed[ids.reshape(-1).to(dev)]), f(hidden.reshape(T, -1).to(dev))
        x = (hid if m.eagle3 else torch.cat([emb, hid], -1)) @ f(m.fc_w).t()
        if m.fc_b is not None:
            x = x + f(m.fc_b)
        pos = torch.tensor([l + j for l in prefix for j in range(n)], device=dev)
        page = torch.gather(table.to(dev), 1, (pos // ps).view(b, n)).reshape(-1)
        loc = page * ps + pos % ps
        ang = pos.float()[:, None] * m.inv_freq[None, :]
        rs = P["rope_scale"]
        cos, sin = (ang.cos() * rs)[:, None, :], (ang.sin() * rs)[:, None, :]

        def rope(t):
            t1, t2 = t[..., :half], t[..., half:]
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

        def rms(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.eps) * f(w)

        for l, w in enumerate(m.layers):
            if l == 0 and m.eagle3:
                h = torch.cat([rms(emb, w["emb_norm"]), rms(x, w["hidden_norm"])], -1)
            else:
                h = x if w["in_norm"] is None else rms(x, w["in_norm"])
            qkv = h @ f(w["qkv"]).t()
            q = rope(qkv[:, : hq * D].view(T, hq, D))
            k = rope(qkv[:, hq * D : (hq + hkv) * D].view(T, hkv, D))
            v = qkv[:, (hq + hkv) * D :].view(T, hkv, D)
            kc[l].view(-1, hkv, D)[loc] = k
            vc[l].view(-1, hkv, D)[loc] = v
            win = P["windows"][l]
            o = torch.empty(T, hq, D, device=dev)
            for i in range(b):
                L = prefix[i]
                kpos = torch.arange(L + n, device=dev)
                kloc = table[i].to(dev)[kpos // ps] * ps + kpos % ps
                K = kc[l].view(-1, hkv, D)[kloc].repeat_interleave(G, dim=1)  # [kv, hq, D]
                V = vc[l].view(-1, hkv, D)[kloc].repeat_interleave(G, dim=1)
                Q = q[i * n : (i + 1) * n]  # [n, hq, D]
                S = torch.einsum("qhd,khd->hqk", Q, K) * P["attn_scale"]
                qp = (L + torch.arange(n, device=dev))[:, None]
                mask = kpos[None, :] <= qp
                if win is not None:
                    mask &= kpos[None, :] > qp - win
                S = S.masked_fill(~mask[None], float("-inf"))
                o[i * n : (i + 1) * n] = torch.einsum("hqk,khd->qhd", torch.softmax(S, -1), V)
            x = x + o.reshape(T, hq * D) @ f(w["o"]).t()
            gu = rms(x, w["post_norm"]) @ f(w["gate_up"]).t()
            g, u = gu.chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ f(w["down"]).t()
        sel = torch.tensor([i * n + min(max(a, 1), n) - 1 for i, a in enumerate(accept)], device=dev)
        hs = x[sel]
        lm_in = hs if m.final_norm is None else rms(hs, m.final_norm)
        probs = torch.softmax(lm_in @ f(m.lm).t(), -1)
        return hs, probs, kc, vc
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# ---------------------------------------------------------------------------------------------
# The equal-output check.


def rel_rows(a, r):
    """Largest per-row relative RMS error of a against r (2-D, fp32)."""
    num = (a - r).pow(2).sum(-1)
    den = r.pow(2).sum(-1).clamp_min(1e-30)
    return float((num / den).sqrt().max())


def run_check(fi, P, name, W, inputs_path, ref_path, work, dev):
    t0 = time.perf_counter()
    X = st_load(inputs_path)
    R = st_load(ref_path)
    dt = P["act"]
    ids, hidden = X["input_ids"], X["hidden_states"]
    b, n = ids.shape
    if n != P["num_draft_tokens"]:
        raise ValueError(f"{inputs_path}: input_ids has N = {n}, the plan {P['num_draft_tokens']}")
    if tuple(hidden.shape) != (b, n, P["hidden_in"]):
        want = (b, n, P["hidden_in"])
        raise ValueError(f"{inputs_path}: hidden_states of shape {tuple(hidden.shape)}, the plan {want}")
    prefix = [int(x) for x in X["prefix_lens"].tolist()]
    accept = [int(x) for x in X["accept_lens"].tolist()]
    table = X["page_table"].long()
    kc0, vc0 = X["k_cache"], X["v_cache"]
    m = Model(P, W, dev)
    lay = Layout(P, prefix, table, accept)
    kc, vc = kc0.to(dev, dt).contiguous(), vc0.to(dev, dt).contiguous()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    attn = Attention(fi, P, b, int(lay.kv_indices.numel()), ws, dev)
    attn.set_layout(lay, dev)
    step = Step(m, attn, kc, vc, b, dev)
    step.set_inputs(ids, lay, hidden.to(dev, dt))
    graph, outs, _ = capture(step)
    kc.copy_(kc0.to(dev, dt))  # the warm-up forwards wrote this step's slots already
    vc.copy_(vc0.to(dev, dt))
    step.stage()
    attn.plan()
    graph.replay()
    sync()
    hs, p, i, probs = [t.clone() for t in outs]
    st_save(
        os.path.join(work, f"{name}.{os.path.basename(inputs_path)}.peer.safetensors"),
        {"hidden_out": hs, "topk_probs": p.float(), "topk_ids": i.long(), "k_cache": kc, "v_cache": vc},
    )
    r_hs, r_probs, r_kc, r_vc = reference_f32(m, P, ids, hidden, prefix, accept, table, kc0, vc0, dev)

    s_hs = R["hidden_out"].to(dev).float()
    s_p = R["topk_probs"].to(dev).float()
    s_i = R["topk_ids"].to(dev).long()
    K = P["topk"]
    if tuple(s_p.shape) != (b, K) or tuple(s_hs.shape) != (b, P["hidden"]):
        raise ValueError(f"{ref_path}: outputs of shape {tuple(s_hs.shape)}, {tuple(s_p.shape)}; expected b = {b}")
    res = {"plan": name, "head": P["head"], "inputs": os.path.basename(inputs_path), "batch": b, "prefixes": prefix,
           "failures": []}
    fail = res["failures"]
    res["hidden_rel_peer_vs_specplan"] = rel_rows(hs.float(), s_hs)
    res["hidden_rel_peer_vs_f32"] = rel_rows(hs.float(), r_hs)
    res["hidden_rel_specplan_vs_f32"] = rel_rows(s_hs, r_hs)
    if not res["hidden_rel_peer_vs_specplan"] <= HIDDEN_REL_PEER_SPEC:
        fail.append(f"hidden_out peer vs specplan {res['hidden_rel_peer_vs_specplan']:.3e} > {HIDDEN_REL_PEER_SPEC}")
    for who in ("peer", "specplan"):
        e = res[f"hidden_rel_{who}_vs_f32"]
        if not e <= HIDDEN_REL_F32:
            fail.append(f"hidden_out {who} vs fp32 reference {e:.3e} > {HIDDEN_REL_F32}")

    pp = p.float()
    dp = (pp - s_p).abs()
    bound = prob_bound(torch.maximum(pp, s_p))
    res["prob_abs_max"] = float(dp.max())
    res["prob_rel_max"] = float((dp / s_p.clamp_min(1e-12)).max())
    res["prob_ref_max"] = float(s_p.max())
    bad = (dp > bound) | ~torch.isfinite(pp)
    for bi, si in bad.nonzero().tolist()[:6]:
        fail.append(f"req {bi} slot {si}: prob peer {float(pp[bi, si]):.6g} vs specplan {float(s_p[bi, si]):.6g}")

    # Top-K ids: equal, except where the peer's own probabilities of the two ids tie within
    # the probability bound (a swap of neighbours, or the K-th against the (K+1)-th).
    ids_peer = i.long()
    ties, mism = 0, 0
    for bi, si in (ids_peer != s_i).nonzero().tolist():
        sid = int(s_i[bi, si])
        if m.id_map is not None:  # the column specplan's id came from (FR-Spec hot rows, EAGLE-3 d2t)
            where = (m.id_map == sid).nonzero()
            col = int(where[0, 0]) if where.numel() else -1
        else:
            col = sid if 0 <= sid < probs.shape[1] else -1
        a = float(probs[bi, col]) if col >= 0 else -1.0
        c = float(pp[bi, si])
        if col >= 0 and abs(a - c) <= prob_bound(max(a, c)):
            ties += 1
        else:
            mism += 1
            if mism <= 6:
                fail.append(f"req {bi} slot {si}: id peer {int(ids_peer[bi, si])} (p {c:.6g}) vs specplan {sid} (peer p {a:.6g})")
    res["ids_equal"] = int((ids_peer == s_i).sum())
    res["ids_total"] = b * K
    res["ids_tied"] = ties
    res["ids_mismatch"] = mism

    # K/V: written rows against specplan's and the fp32 reference; every other row as given.
    hkv, D = P["kv_heads"], P["head_dim"]
    written = torch.zeros(kc0.shape[1] * kc0.shape[2], dtype=torch.bool, device=dev)
    written[lay.loc.to(dev)] = True
    kv_rel, kv_rel32, untouched = 0.0, 0.0, 0
    for which, mine, given, spec, ref in (("k", kc, kc0, R["k_cache"], r_kc), ("v", vc, vc0, R["v_cache"], r_vc)):
        if tuple(spec.shape) != tuple(given.shape):
            fail.append(f"{which}_cache: specplan's has shape {tuple(spec.shape)}, the input {tuple(given.shape)}")
            continue
        g = given.to(dev)
        for layer in range(given.shape[0]):
            rows = lambda t: t[layer].reshape(-1, hkv * D)  # noqa: E731
            a, s_, r_, g_ = rows(mine), rows(spec.to(dev)), rows(ref), rows(g)
            w = written
            e = float(((a[w].float() - s_[w].float()).pow(2).sum() / s_[w].float().pow(2).sum().clamp_min(1e-30)).sqrt())
            e32 = float(((a[w].float() - r_[w]).pow(2).sum() / r_[w].pow(2).sum().clamp_min(1e-30)).sqrt())
            kv_rel, kv_rel32 = max(kv_rel, e), max(kv_rel32, e32)
            if not e <= KV_REL:
                fail.append(f"{which}_cache layer {layer}: written rows peer vs specplan {e:.3e} > {KV_REL}")
            for who, t in (("peer", a), ("specplan", s_)):
                changed = int((t[~w].view(torch.int16) != g_[~w].to(t.dtype).view(torch.int16)).any(-1).sum())
                untouched += changed
                if changed:
                    fail.append(f"{which}_cache layer {layer}: {who} changed {changed} rows it does not own")
    res["kv_rel_peer_vs_specplan"] = kv_rel
    res["kv_rel_peer_vs_f32"] = kv_rel32
    res["kv_untouched_changed"] = untouched
    res["ok"] = not fail
    res["seconds"] = round(time.perf_counter() - t0, 2)
    del graph, outs, step, attn, ws, kc, vc
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# The benchmark.


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def replay_median(g, runs, warmup, flush=None):
    """Median µs of `runs` replays of graph `g` after `warmup`, CUDA events, as specbench times
    replays: L2 flushed before each run (outside the events), so a small step's K/V and
    weights are read from HBM as in a running engine."""
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    v = []
    for it in range(warmup + runs):
        if flush is not None:
            flush.fill_(it & 0xFF)
        ev0.record()
        g.replay()
        ev1.record()
        ev1.synchronize()
        if it >= warmup:
            v.append(ev0.elapsed_time(ev1) * 1e3)
    return median(v)


def bench_shape(fi, m, P, name, B, L, runs, warmup, ws, dev, seed, flush=None):
    n, ps, dt = P["num_draft_tokens"], P["page_size"], P["act"]
    hq, hkv, D, layers = P["heads"], P["kv_heads"], P["head_dim"], P["layers"]
    per = (L + n + ps - 1) // ps
    pages = B * per
    gen = torch.Generator()
    gen.manual_seed(seed)
    kc = torch.empty(layers, pages, ps, hkv, D, dtype=dt, device=dev).uniform_(-1.0, 1.0)
    vc = torch.empty(layers, pages, ps, hkv, D, dtype=dt, device=dev).uniform_(-1.0, 1.0)
    table = torch.randperm(pages, generator=gen).view(B, per)  # scattered pages
    lay = Layout(P, [L] * B, table, [n] * B)
    attn = Attention(fi, P, B, pages, ws, dev)
    attn.set_layout(lay, dev)
    step = Step(m, attn, kc, vc, B, dev)
    ids = torch.randint(0, P["vocab"], (B, n), generator=gen)
    hidden_src = torch.empty(B * n, P["hidden_in"], dtype=dt, device=dev).uniform_(-1.0, 1.0)
    step.set_inputs(ids, lay, hidden_src)
    graph, outs, capture_ms = capture(step)

    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls, preps, plans, evs = [], [], [], []
    for it in range(warmup + runs):
        t0 = time.perf_counter()
        ev0.record()
        step.stage()
        t1 = time.perf_counter()
        attn.plan()
        t2 = time.perf_counter()
        graph.replay()
        ev1.record()
        ev1.synchronize()
        t3 = time.perf_counter()
        if it >= warmup:
            walls.append((t3 - t0) * 1e6)
            preps.append((t2 - t0) * 1e6)
            plans.append((t2 - t1) * 1e6)
            evs.append(ev0.elapsed_time(ev1) * 1e3)

    replay = replay_median(graph, runs, warmup, flush)

    # FlashInfer attention alone: run() for every layer, captured; plan() stays outside.
    q = torch.empty(B * n, hq, D, dtype=dt, device=dev).uniform_(-1.0, 1.0)
    o = torch.empty(B * n, hq, D, dtype=dt, device=dev)
    attn.plan()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for l in range(layers):
            attn.run(l, q, kc[l], vc[l], o)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ga = torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga):
        for l in range(layers):
            attn.run(l, q, kc[l], vc[l], o)
    torch.cuda.synchronize()
    attn_us = replay_median(ga, runs, warmup, flush)
    act = torch.empty((), dtype=dt).element_size()
    # specbench's useful bytes: K/V read (prefix + N rows), q read, o written, every layer.
    attn_bytes = (B * (L + n) * hkv * D * act * 2 + 2 * B * n * hq * D * act) * layers
    row = {
        "plan": name,
        "batch": B,
        "prefix": L,
        "n": n,
        "heads": f"{hq}/{hkv}",
        "head": P["head"],
        "lm_vocab": P["lm_vocab"],
        "hidden_in": P["hidden_in"],
        "gemm_weight_bytes": m.gemm_weight_bytes,
        "pages": "scattered",
        "page_size": ps,
        "prep_us": round(median(preps), 2),
        "plan_us": round(median(plans), 2),
        "replay_us": round(replay, 1),
        "step_us": round(median(walls), 1),
        "step_event_us": round(median(evs), 1),
        "attn_us": round(attn_us, 1),
        "attn_bytes": attn_bytes,
        "attn_tb_s": round(attn_bytes / (attn_us * 1e-6) / 1e12, 3),
        "graph_capture_ms": round(capture_ms, 1),
        "l2_flush_bytes": 0 if flush is None else flush.numel(),
        "runs": runs,
        "warmup": warmup,
    }
    del graph, ga, outs, step, attn, kc, vc, q, o, hidden_src
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------


class Results:
    def __init__(self, path, meta):
        self.path = path
        self.doc = dict(meta, checks=[], rows=[], errors=[])
        self.save()

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.path)

    def add(self, key, item):
        self.doc[key].append(item)
        self.save()

    def error(self, what, exc):
        msg = f"{what}: {type(exc).__name__}: {exc}"
        log("ERROR", msg)
        traceback.print_exc()
        self.add("errors", msg)


def cuda_alive():
    try:
        torch.cuda.synchronize()
        return True
    except Exception as e:  # a sticky CUDA error: nothing more can run in this process
        log(f"CUDA context unusable: {e}")
        return False


def import_flashinfer():
    import flashinfer  # noqa: F401  (the wheel travels; see the module docstring)

    return flashinfer


def device():
    # PEER_DEVICE=cpu serves the CPU self-test (cpu_selftest.py) only.
    return torch.device(os.environ.get("PEER_DEVICE", "cuda"))


def device_name():
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def cmd_warmup(args):
    dev = device()
    t0 = time.perf_counter()
    fi = import_flashinfer()
    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), flashinfer {fi.__version__}, "
        f"device {device_name()}; import {time.perf_counter() - t0:.1f} s")
    done = set()
    for path in args.plan_json:
        P = load_plan(path)
        for w in sorted({window_left(x) for x in P["windows"]}):
            key = (P["dtype"], P["head_dim"], w >= 0)
            if key in done:
                continue
            done.add(key)
            t1 = time.perf_counter()
            n, ps = P["num_draft_tokens"], P["page_size"]
            ws = torch.empty(16 << 20, dtype=torch.uint8, device=dev)
            wr = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
            kv_len = 2 * n
            npages = (kv_len + ps - 1) // ps
            wr.plan(
                torch.tensor([0, n], dtype=torch.int32),
                torch.tensor([0, npages], dtype=torch.int32),
                torch.arange(npages, dtype=torch.int32, device=dev),
                torch.tensor([(kv_len - 1) % ps + 1], dtype=torch.int32),
                P["heads"], P["kv_heads"], P["head_dim"], ps,
                causal=True, window_left=w, q_data_type=P["act"], kv_data_type=P["act"],
            )
            q = torch.randn(n, P["heads"], P["head_dim"], dtype=P["act"], device=dev)
            kc = torch.randn(npages, ps, P["kv_heads"], P["head_dim"], dtype=P["act"], device=dev)
            o = wr.run(q, (kc, kc.clone()))
            torch.cuda.synchronize()
            if not torch.isfinite(o.float()).all():
                raise RuntimeError(f"warm-up attention {key} produced non-finite values")
            log(f"fa2 module {key}: ready in {time.perf_counter() - t1:.1f} s")
    log(f"warm-up done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_run(args):
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = False
    plans = []
    for name, path in args.plan:
        plans.append((name, load_plan(path)))
    byname = dict(plans)
    meta = {
        "tool": "tests/peer/flashinfer_peer.py",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device_name(),
        "python": sys.version.split()[0],
        "settings": {
            "backend": "fa2",
            "use_cuda_graph": True,
            "uniform_q_len": "N",
            "plan_in_step": True,
            "pages": "scattered (random permutation)",
            "runs": args.runs,
            "warmup": args.warmup,
            "l2_flush_mb": args.l2_flush_mb,
            "bounds": {
                "hidden_rel_peer_vs_specplan": HIDDEN_REL_PEER_SPEC,
                "hidden_rel_vs_f32": HIDDEN_REL_F32,
                "kv_rel": KV_REL,
                "prob": f"max(min({PROB_ABS}, {PROB_REL}·p + 1e-5), {PROB_LOGIT}·p)",
            },
        },
    }
    res = Results(args.json, meta)
    try:
        t0 = time.perf_counter()
        fi = import_flashinfer()
        res.doc["flashinfer"] = fi.__version__
        res.save()
        log(f"flashinfer {fi.__version__} imported in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}")
    except Exception as e:
        res.error("import flashinfer", e)
        return 3
    work = args.work or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(work, exist_ok=True)
    failed_check, errors = False, False

    if args.check:
        W = None
        try:
            t0 = time.perf_counter()
            W = {k: v.to(dev) for k, v in st_load(args.weights).items()}
            log(f"weights {args.weights}: {len(W)} tensors in {time.perf_counter() - t0:.1f} s")
        except Exception as e:
            res.error(f"load weights {args.weights}", e)
            errors = True
        for name, inputs, ref in args.check if W is not None else []:
            try:
                P = byname[name]
                W2 = {k: (v.to(P["act"]) if v.is_floating_point() else v) for k, v in W.items()}
                c = run_check(fi, P, name, W2, inputs, ref, work, dev)
                del W2
                res.add("checks", c)
                failed_check |= not c["ok"]
                log(
                    f"check {name} {c['inputs']} b={c['batch']}: {'ok' if c['ok'] else 'MISMATCH'}; hidden rel "
                    f"peer/specplan {c['hidden_rel_peer_vs_specplan']:.2e}, peer/f32 {c['hidden_rel_peer_vs_f32']:.2e}, "
                    f"specplan/f32 {c['hidden_rel_specplan_vs_f32']:.2e}; probs max |Δ| {c['prob_abs_max']:.2e} "
                    f"(p ≤ {c['prob_ref_max']:.3g}); ids {c['ids_equal']}/{c['ids_total']} equal, {c['ids_tied']} ties, "
                    f"{c['ids_mismatch']} mismatched; kv rel {c['kv_rel_peer_vs_specplan']:.2e}"
                )
                for f_ in c["failures"]:
                    log("    " + f_)
            except Exception as e:
                res.error(f"check {name} {inputs}", e)
                errors = True
                if not cuda_alive():
                    return 2
        del W
        torch.cuda.empty_cache()

    if args.bench:
        batches = [int(x) for x in args.batches.split(",") if x]
        prefixes = [int(x) for x in args.prefixes.split(",") if x]
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        flush = torch.empty(args.l2_flush_mb << 20, dtype=torch.uint8, device=dev) if args.l2_flush_mb > 0 else None
        model, model_key = None, None
        for k, (name, P) in enumerate(plans):
            key = (P["head"], P["hidden"], P["hidden_in"], P["intermediate"], P["heads"], P["kv_heads"], P["head_dim"],
                   P["layers"], P["vocab"], P["draft_vocab"], P["fc_bias"], P.get("hot_vocab_size"), P["dtype"],
                   tuple(P["rope_inv_freq_bits"]), P["rms_norm_eps_bits"])
            try:
                if key != model_key:
                    model = None
                    torch.cuda.empty_cache()
                    W = random_weights(P, dev, seed=1234)
                    model = Model(P, W, dev)
                    del W
                    model_key = key
                else:
                    model.P = P
            except Exception as e:
                res.error(f"bench {name}: weights", e)
                errors = True
                if not cuda_alive():
                    return 2
                continue
            n = P["num_draft_tokens"]
            for L in prefixes:
                if L + n > P["max_context_len"]:
                    log(f"bench {name}: L={L} skipped (L + N > max context {P['max_context_len']})")
                    continue
                for B in batches:
                    try:
                        t0 = time.perf_counter()
                        row = bench_shape(fi, model, P, name, B, L, args.runs, args.warmup, ws, dev, seed=B * 7919 + L,
                                          flush=flush)
                        res.add("rows", row)
                        log(
                            f"{name} B={B} L={L}: step {row['step_us']} µs (plan {row['plan_us']} µs), replay "
                            f"{row['replay_us']} µs, attn {row['attn_us']} µs = {row['attn_tb_s']} TB/s "
                            f"[{time.perf_counter() - t0:.1f} s]"
                        )
                    except Exception as e:
                        res.error(f"bench {name} B={B} L={L}", e)
                        errors = True
                        if not cuda_alive():
                            return 2
                        torch.cuda.empty_cache()
    if failed_check:
        log("equal-output check FAILED (see the lines above and 'checks' in the JSON)")
        return 1
    return 2 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmup", help="import FlashInfer and build the fa2 modules the plans need")
    w.add_argument("--plan-json", nargs="+", required=True)
    r = sub.add_parser("run", help="equal-output checks and/or the benchmark")
    r.add_argument("--plan", nargs=2, action="append", metavar=("NAME", "PLAN_JSON"), required=True)
    r.add_argument("--weights", help="weights file of the checks (peerprep weights)")
    r.add_argument("--check", nargs=3, action="append", metavar=("NAME", "INPUTS", "SPECPLAN_OUT"))
    r.add_argument("--bench", action="store_true")
    r.add_argument("--batches", default="1,8,32,64")
    r.add_argument("--prefixes", default="1024,4096")
    r.add_argument("--runs", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--l2-flush-mb", type=int, default=256, help="L2 flush before each timed replay (0: none)")
    r.add_argument("--json", required=True)
    r.add_argument("--work", help="where the peer's output files go (default: beside --json)")
    a = ap.parse_args()
    if not torch.cuda.is_available() and device().type == "cuda":
        log("no CUDA device: nothing to do")
        return 2
    if a.cmd == "warmup":
        return cmd_warmup(a)
    if a.check and not a.weights:
        ap.error("--check needs --weights")
    names = {n for n, _ in a.plan}
    for n, _, _ in a.check or []:
        if n not in names:
            ap.error(f"--check {n}: no --plan of that name")
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
