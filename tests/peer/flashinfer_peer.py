#!/usr/bin/env python3
"""The peer for issue 5: the same draft-extend forward in PyTorch + FlashInfer, as an engine
runs it today — FlashInfer fa2 BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True) with
uniform_q_len = N, everything else in torch, the whole forward captured in one CUDA graph,
and the wrapper's plan() run on the host before every replay (its cost is part of the step).

Status (2026-11-30): written against FlashInfer 0.7.2's documented API but NOT YET RUN on
the GPU machine (the session's device time was spent). Run it before trusting it:

  python3 flashinfer_peer.py --weights W.safetensors --inputs I.safetensors \
      --n N --topk K [--page-size P] [--window W] [--hot] --out O.safetensors --timing T.json

It reads the `specplan run` contract files (the same ones `gpucheck contract` writes), writes
the contract's outputs (so they can be compared with `specplan run --device cuda`), and times
steps with CUDA events (median of 100 after 10 warm-up), plan() host time separately.

FlashInfer travels as wheels (see shared/domain/flashinfer.md §5): flashinfer-python
0.7.2.post1 (62 MB) + apache-tvm-ffi. `tests/peer/prepare_wheels.py .whl` downloads them
and slims flashinfer's to 31 MB (unrelated kernel sources dropped), so `.whl` (34 MB) and
`target/gpu-bundle` (12 MB) fit in one device call's 64 MiB: carry both, then
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl`, `PYTHONPATH=/tmp/site`,
`FLASHINFER_CUDA_ARCH_LIST=9.0a`, and budget ~25 s for FlashInfer's fa2 JIT.
"""
import argparse
import json
import time

import torch
from safetensors.torch import load_file, save_file


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope(x, pos, inv_freq):
    # Hugging Face Llama rotate-half; x: [T, heads, D], pos: [T].
    freqs = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--topk", type=int, required=True)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--theta", type=float, default=10000.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timing", required=True)
    a = ap.parse_args()

    import flashinfer

    dev = "cuda"
    W = {k: v.to(dev) for k, v in load_file(a.weights).items()}
    X = {k: v.to(dev) for k, v in load_file(a.inputs).items()}
    N, K, ps = a.n, a.topk, a.page_size
    layers = X["k_cache"].shape[0]
    H = W["fc.weight"].shape[0]
    D = X["k_cache"].shape[-1]
    hkv = X["k_cache"].shape[-2]
    hq = W["layers.0.self_attn.q_proj.weight"].shape[0] // D
    b = X["input_ids"].shape[0]
    inv_freq = 1.0 / (a.theta ** (torch.arange(0, D, 2, device=dev).float() / D))

    qkv_w = [torch.cat([W[f"layers.{l}.self_attn.{p}_proj.weight"] for p in "qkv"]) for l in range(layers)]
    gu_w = [torch.cat([W[f"layers.{l}.mlp.gate_proj.weight"], W[f"layers.{l}.mlp.up_proj.weight"]]) for l in range(layers)]
    lm = W["lm_head.weight"]
    hot = W.get("hot_token_ids") if a.hot else None
    if hot is not None:
        lm = lm[hot]

    k_cache, v_cache = X["k_cache"].clone(), X["v_cache"].clone()
    prefix = X["prefix_lens"].long()
    table = X["page_table"].long()
    pos = (prefix[:, None] + torch.arange(N, device=dev)[None, :]).reshape(-1)
    req = torch.arange(b, device=dev).repeat_interleave(N)
    page = table[req, pos // ps]
    slot = pos % ps

    # Host-known layout, as SGLang's graph path passes it (no device-to-host copies).
    prefix_cpu = X["prefix_lens"].cpu().long()
    kv_len = prefix_cpu + N
    pages_per = (kv_len + ps - 1) // ps
    qo_indptr = torch.arange(0, (b + 1) * N, N, dtype=torch.int32)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages_per.cumsum(0)]).int()
    table_cpu = X["page_table"].cpu()
    kv_indices = torch.cat([table_cpu[i, : pages_per[i]] for i in range(b)]).int()
    last_page_len = ((kv_len - 1) % ps + 1).int()

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrappers = []
    for _ in range(layers):
        wrappers.append(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.empty(kv_indices.numel(), dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.empty(b, dtype=torch.int32, device=dev),
                backend="fa2",
            )
        )

    def plan():
        for w in wrappers:
            w.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                last_page_len,
                hq,
                hkv,
                D,
                ps,
                causal=True,
                window_left=a.window - 1 if a.window > 0 else -1,
                q_data_type=torch.bfloat16,
                kv_data_type=k_cache.dtype,
                uniform_q_len=N,
            )

    ids = X["input_ids"].reshape(-1)
    hidden = X["hidden_states"].reshape(b * N, H).to(torch.bfloat16)
    accept = X["accept_lens"].long()

    def forward():
        x = torch.cat([W["embed_tokens.weight"][ids], hidden], dim=-1) @ W["fc.weight"].t()
        if "fc.bias" in W:
            x = x + W["fc.bias"]
        for l in range(layers):
            h = x if l == 0 else rms_norm(x, W[f"layers.{l}.input_layernorm.weight"], a.eps)
            qkv = h @ qkv_w[l].t()
            q = qkv[:, : hq * D].view(-1, hq, D)
            k = qkv[:, hq * D : (hq + hkv) * D].view(-1, hkv, D)
            v = qkv[:, (hq + hkv) * D :].view(-1, hkv, D)
            q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
            k_cache[l][page, slot] = k
            v_cache[l][page, slot] = v
            o = wrappers[l].run(q, (k_cache[l], v_cache[l]))
            x = x + o.reshape(-1, hq * D) @ W[f"layers.{l}.self_attn.o_proj.weight"].t()
            h2 = rms_norm(x, W[f"layers.{l}.post_attention_layernorm.weight"], a.eps)
            gu = h2 @ gu_w[l].t()
            inter = gu.shape[-1] // 2
            x = x + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ W[f"layers.{l}.mlp.down_proj.weight"].t()
        hidden_out = x.view(b, N, H)[torch.arange(b, device=dev), accept - 1]
        probs = torch.softmax((hidden_out @ lm.t()).float(), dim=-1)
        p, i = torch.topk(probs, K, dim=-1)
        if hot is not None:
            i = hot[i]
        return hidden_out, p, i

    plan()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(s)
    # Restore the caller's cache before the run whose outputs are compared.
    k_cache.copy_(X["k_cache"])
    v_cache.copy_(X["v_cache"])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = forward()
    k_cache.copy_(X["k_cache"])
    v_cache.copy_(X["v_cache"])
    plan()
    g.replay()
    torch.cuda.synchronize()
    hidden_out, p, i = outs
    save_file(
        {
            "topk_probs": p.float().contiguous().cpu(),
            "topk_ids": i.long().contiguous().cpu(),
            "hidden_out": hidden_out.to(torch.bfloat16).contiguous().cpu(),
            "k_cache": k_cache.contiguous().cpu(),
            "v_cache": v_cache.contiguous().cpu(),
        },
        a.out,
    )

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    steps, plans = [], []
    for it in range(110):
        start.record()
        t0 = time.perf_counter()
        plan()
        t1 = time.perf_counter()
        g.replay()
        end.record()
        end.synchronize()
        if it >= 10:
            steps.append(start.elapsed_time(end) * 1e3)
            plans.append((t1 - t0) * 1e6)
    steps.sort()
    plans.sort()
    json.dump({"step_us": steps[len(steps) // 2], "plan_host_us": plans[len(plans) // 2], "runs": len(steps)}, open(a.timing, "w"))
    print(json.dumps({"step_us": steps[len(steps) // 2], "plan_host_us": plans[len(plans) // 2]}))


if __name__ == "__main__":
    main()
