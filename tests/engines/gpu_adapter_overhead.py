"""The SGLang adapter's cost per draft-extend step on the GPU, without SGLang installed (its
release cannot travel to the GPU machine: sgl-kernel alone is 373 MB): the slot's
`execute(forward_batch, select_index)` on a stand-in forward batch of real CUDA tensors in
SGLang 0.5.23's dtypes and shapes, against `DraftExtendRunner.run` and the native step it
calls. Host time per call (median of many, no synchronization), and the step's GPU time
(CUDA events) for each batch size. The release-code tests of the same adapter:
test_sglang_0523.py (CPU).

usage: gpu_adapter_overhead.py PLAN [--out FILE.json]
"""

import argparse
import json
import statistics
import time
import types

import torch

import specplan
from specplan.sglang import SGLangDraftExtendRunner


def weights(plan, dev, gen):
    w = {}
    for name, dt, shape, _ in plan.weights():
        if dt == "i64":
            w[name] = torch.randint(0, plan.vocab_size, tuple(shape), generator=gen, device=dev)
        else:
            scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
            w[name] = (torch.randn(*shape, generator=gen, device=dev) * scale).to(torch.bfloat16)
            if len(shape) == 1:
                w[name] = (1 + 0.1 * torch.randn(*shape, generator=gen, device=dev)).to(torch.bfloat16)
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    plan = specplan.Plan.load(a.plan)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    n, ctx = plan.num_draft_tokens, 1024
    rows = plan.max_requests + 1
    slots = rows * ctx
    kv = [torch.randn(slots, plan.num_kv_heads, plan.head_dim, generator=gen, device=dev).to(torch.bfloat16)
          for _ in range(2 * plan.num_layers)]
    table = torch.randperm(slots, generator=gen, device=dev).int().view(rows, ctx)
    runner = specplan.DraftExtendRunner(plan, weights(plan, dev, gen), kv[: plan.num_layers], kv[plan.num_layers:],
                                        req_to_token=table)
    slot = SGLangDraftExtendRunner(runner, draft_runner=types.SimpleNamespace(shared_read_done_event=None))
    report = []
    for b in [x for x in (1, 8, 32, 64) if x in plan.graph_buckets]:
        # SGLang 0.5.23's fields at execute: ids int64 [b*N], seq_lens = L + N int64, rows
        # int64 (row 0 is padding), select_index int64, target hidden [b*N, H_in].
        L = 700
        fb = types.SimpleNamespace(
            input_ids=torch.randint(0, plan.vocab_size, (b * n,), generator=gen, device=dev),
            seq_lens=torch.full((b,), L + n, dtype=torch.int64, device=dev),
            seq_lens_cpu=None,
            req_pool_indices=torch.arange(1, b + 1, dtype=torch.int64, device=dev),
            spec_info=types.SimpleNamespace(
                num_tokens_per_req=n,
                hidden_states=torch.randn(b * n, plan.hidden_in_size, generator=gen, device=dev).to(torch.bfloat16)),
        )
        accept = torch.randint(1, n + 1, (b,), generator=gen, device=dev)
        select = torch.arange(b, device=dev) * n + accept - 1
        assert slot.can_run_graph(fb)
        for _ in range(20):
            slot.execute(fb, select)
        torch.cuda.synchronize()
        host = {"execute": [], "run": [], "native": []}
        eng = runner._engine
        ptrs = runner._own_ptrs()
        stream = torch.cuda.current_stream().cuda_stream
        for it in range(a.iters):
            t0 = time.perf_counter_ns()
            slot.execute(fb, select)
            t1 = time.perf_counter_ns()
            runner.run(fb.input_ids, fb.spec_info.hidden_states, fb.req_pool_indices, fb.seq_lens, select,
                       prefix_includes_new_tokens=True, accept_is_select_index=True)
            t2 = time.perf_counter_ns()
            eng.step(b, fb.input_ids.data_ptr(), False, fb.spec_info.hidden_states.data_ptr(),
                     fb.req_pool_indices.data_ptr(), False, fb.seq_lens.data_ptr(), False, -n, select.data_ptr(),
                     False, True, *ptrs, stream)
            t3 = time.perf_counter_ns()
            host["execute"].append(t1 - t0)
            host["run"].append(t2 - t1)
            host["native"].append(t3 - t2)
            if it % 8 == 7:
                torch.cuda.synchronize()
        gpu = []
        for _ in range(100):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            slot.execute(fb, select)
            e1.record()
            e1.synchronize()
            gpu.append(e0.elapsed_time(e1) * 1e3)
        assert runner.last_error() is None
        med = {k: statistics.median(v) / 1e3 for k, v in host.items()}
        row = dict(b=b, L=L, step_gpu_us=statistics.median(gpu), execute_host_us=med["execute"],
                   run_host_us=med["run"], native_step_host_us=med["native"],
                   adapter_over_run_us=med["execute"] - med["run"], binding_us=med["run"] - med["native"])
        report.append(row)
        print(f"sglang slot b {b:>3} L {L}: step {row['step_gpu_us']:.1f} µs GPU; host execute {med['execute']:.1f} µs "
              f"= run {med['run']:.1f} + adapter {row['adapter_over_run_us']:.1f}; run = native {med['native']:.1f} "
              f"+ binding {row['binding_us']:.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(plan=plan.name, rows=report), f, indent=1)


if __name__ == "__main__":
    main()
