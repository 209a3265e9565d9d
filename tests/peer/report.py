#!/usr/bin/env python3
"""The benchmark report: specbench (specplan) beside the PyTorch + FlashInfer peer and
the bandwidth/compute floor, from the JSON the two write. Python standard library only.

  report.py --specbench specbench.json [--peer peer-a.json ...] [--device device.txt]
            [--commit SHA] [--previous report.json ...] [--engine-memory engine-memory.json] --out DIR

Writes DIR/report.md (tables), DIR/report.json (the rows joined by model, N, L, B) and
DIR/report.svg (step time vs bucket, specplan vs peer vs floor, one panel per model, N, L),
and prints the main table. Where an EAGLE-3 model and its EAGLE-1 partner (HEAD_PAIRS) were
both measured, report.md compares their step times at equal shapes. Without specbench.json, the rows of specbench.txt beside it are
read (a run cut short prints them as it goes). Missing values show as "—". With --previous
(the last full reports' report.json, one per GPU: the one of this run's GPU is used), the
benchmark targets are judged (criteria.py): a section of
report.md, "criteria" in report.json, and the verdict as the last lines printed. With
--engine-memory (`gpucheck engine-memory`'s file), report.md shows what each plan's load with
every bucket graphed adds to device memory, and the targets judge it against its bound.
"""
import argparse
import json
import os
import re
import sys

import criteria

# The peer figures the benchmark issue quotes (H200, PyTorch + FlashInfer graphs), µs.
ISSUE_PEER = {
    ("llama2-7b-eagle", 4, 1024, 1): 449,
    ("llama2-7b-eagle", 4, 1024, 64): 896,
    ("llama2-7b-eagle", 16, 1024, 1): 459,
    ("llama2-7b-eagle", 16, 1024, 64): 1577,
    ("llama2-7b-eagle", 4, 4096, 1): 457,
    ("llama2-7b-eagle", 4, 4096, 64): 1612,
    ("llama3-8b-eagle", 8, 1024, 1): 673,
    ("llama3-8b-eagle", 8, 1024, 64): 1242,
}


# EAGLE-3 heads beside an EAGLE-1 head of the same size (H 4096, NH 32/8, I 14336) at equal
# (N, L, B): the EAGLE-3 head's lm_head has 32000 draft rows instead of 128256 (its fc is
# 3·H_t wide and its q/k/v read 2H, so it is not the vocabulary alone).
HEAD_PAIRS = [("llama3.1-8b-eagle3", "llama3-8b-eagle")]


def split_plan(name):
    """'llama2-7b-eagle-8k-n16' -> ('llama2-7b-eagle-8k', 16)."""
    m = re.match(r"^(.*)-n(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def write_file(path, text):
    """Writes `text` whole or not at all: a temporary file beside `path`, renamed over it."""
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_json(path):
    with open(path) as f:
        return json.load(f)


def same_gpu_previous(paths, device):
    """The first of the previous reports `paths` measured on this run's GPU (`device`: its
    device.txt), else the first one (judged "not compared"). A step time only compares with
    one taken on the same card; the device tool may lend another card than the one asked
    for. Every file must read as a report (an unreadable one is an error, not skipped)."""
    docs = [load_json(p) for p in paths]
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError("not a report.json (no object)")
    here = criteria.gpu_name(device)
    return next((d for d in docs if here and criteria.gpu_name(d.get("device", "")) == here), docs[0])


def read_specbench(path):
    """(ceilings or None, rows) from specbench.json, or from the table rows of specbench.txt."""
    if path and os.path.exists(path):
        doc = load_json(path)
        if isinstance(doc, dict):  # {"ceilings": ..., "rows": [...], "ops": [...], "gemms": [...]}
            return doc.get("ceilings"), doc.get("rows", []), path
        ceil = next((d for d in doc if "copy_bytes_per_s" in d), None)  # older runs: a flat list
        return ceil, [d for d in doc if "plan" in d], path
    txt = os.path.splitext(path or "specbench.json")[0] + ".txt"
    rows, ceil = [], None
    if os.path.exists(txt):
        keys = ["plan", "batch", "prefix", "prep_us", "replay_us", "full_us", "eager_us", "floor_us", "ratio", "attn_us", "attn_tb_s"]
        seen = set()
        with open(txt) as f:
            for line in f:
                m = re.match(r"ceilings: copy ([\d.]+) TB/s, bf16 matmul ([\d.]+) TFLOP/s", line)
                if m:
                    ceil = {"copy_bytes_per_s": float(m.group(1)) * 1e12, "bf16_flops_per_s": float(m.group(2)) * 1e12}
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) != len(keys) or not cells[1].isdigit():
                    continue
                d = {}
                for k, c in zip(keys, cells):
                    if k == "plan":
                        d[k] = c
                    elif k in ("batch", "prefix"):
                        d[k] = int(c)
                    elif k != "ratio":
                        d[k] = float(c)
                if (d["plan"], d["batch"], d["prefix"]) not in seen:
                    seen.add((d["plan"], d["batch"], d["prefix"]))
                    rows.append(d)
        return ceil, rows, txt if rows else None
    return None, [], None


def breakdown_section(doc, ceil):
    """Where a step goes (specbench's in-graph timeline at L 1024, smallest and largest B): the
    GEMMs, attention and the small kernels, each beside its own floor — the GEMMs' weight
    bytes, attention's K/V and q/o bytes (specbench's attention rows), nothing for the small
    kernels (their bytes are a few rows) — and what the event nodes of the instrumented run
    add over the plain replay. The spans run from one event to the next, so each op's launch
    gap is inside its span."""
    if not isinstance(doc, dict) or not doc.get("breakdown") or not ceil:
        return []
    copy = ceil["copy_bytes_per_s"]
    gemms = {}
    for g in doc.get("gemms", []):
        gemms.setdefault(g["plan"], {})[(g["m"], g["n"], g["k"])] = g
    attn = {(r["plan"], r["batch"], r["prefix"]): r for r in doc.get("rows", [])}
    out = [
        "## Where a step goes (in-graph timeline, L2 flushed, L 1024)",
        "",
        "GEMM floor: the bucket's weight bytes over the copy ceiling, or its GEMM FLOPs over the matmul ceiling "
        "when longer. "
        "Attention floor: its useful bytes (specbench's attention row) over the copy ceiling. "
        "Events: what the instrumented graph's event nodes add over the plain replay.",
        "",
        "| plan | B | replay µs | GEMMs µs (share) | GEMM floor µs | GEMMs/floor | attention µs | attention floor µs "
        "| small kernels µs (share) | events µs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    spans = {}
    for sp in doc.get("spans", []):
        spans.setdefault((sp["plan"], sp["batch"], sp["prefix"]), []).append(sp)
    for b in doc["breakdown"]:
        key = (b["plan"], b["batch"], b["prefix"])
        tot = b["gemm_us"] + b["attention_us"] + b["kernel_us"]
        share = lambda x: f"{x:.1f} ({x / tot:.0%})" if tot else fmt(x)
        # The bucket's GEMM launches as specbench recorded them (weight bytes, FLOPs); older
        # runs recorded only the shapes: the layers' at B·N rows, the head's at B rows.
        nm = re.search(r"n(\d+)$", b["plan"])
        wbytes, flops = b.get("gemm_weight_bytes", 0), b.get("gemm_flops", 0)
        if nm and not wbytes:
            rows_bn = b["batch"] * int(nm.group(1))
            shapes = gemms.get(b["plan"], {})
            layer = {(n, k) for (m, n, k) in shapes if m == rows_bn}
            head = {(n, k) for (m, n, k) in shapes if m == b["batch"]} - layer
            # The head's GEMM is the one the layers do not have (lm_head's vocabulary rows).
            head = {max(head)} if head else set()
            wbytes = sum(n * k * 2 for n, k in layer | head)
            flops = sum(2 * rows_bn * n * k for n, k in layer) + sum(2 * b["batch"] * n * k for n, k in head)
        gfloor = max(wbytes / copy, flops / ceil["bf16_flops_per_s"]) * 1e6 if wbytes else None
        r = attn.get(key)
        afloor = (r["attn_us"] * r["attn_tb_s"] * 1e12 / copy) if r and r.get("attn_tb_s") else None
        out.append(
            f"| {b['plan']} | {b['batch']} | {b['replay_us']:.1f} | {share(b['gemm_us'])} | {fmt(gfloor)} "
            f"| {fmt(ratio(b['gemm_us'], gfloor), 2, '×')} | {b['attention_us']:.1f} | {fmt(afloor)} | {share(b['kernel_us'])} "
            f"| {b['timeline_us'] - b['replay_us']:.1f} |"
        )
    out.append("")
    return out


def fmt(x, nd=1, suffix=""):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}{suffix}"
    return f"{x}{suffix}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def join(spec_rows, peer_docs):
    """Rows keyed by (model, N, L, B) with specplan's and the peer's numbers."""
    table = {}
    for r in spec_rows:
        model, n = split_plan(r["plan"])
        key = (model, n, r["prefix"], r["batch"])
        table.setdefault(key, {"model": model, "n": n, "prefix": r["prefix"], "batch": r["batch"], "plan": r["plan"]})
        table[key]["specplan"] = r
    for doc in peer_docs:
        for r in doc.get("rows", []):
            model, n = split_plan(r["plan"])
            n = r.get("n", n)
            key = (model, n, r["prefix"], r["batch"])
            table.setdefault(key, {"model": model, "n": n, "prefix": r["prefix"], "batch": r["batch"], "plan": r["plan"]})
            table[key]["peer"] = r
            table[key]["heads"] = r.get("heads", "")
    out = []
    for key in sorted(table, key=lambda k: (k[0], k[1] or 0, k[2], k[3])):
        e = table[key]
        s, p = e.get("specplan", {}), e.get("peer", {})
        floor = s.get("floor_us")
        e["floor_us"] = floor
        e["op_floor_us"] = s.get("op_floor_us")  # absent from specbench runs before 2026-12-05
        e["specplan_step_us"] = s.get("full_us")
        e["specplan_replay_us"] = s.get("replay_us")
        e["specplan_prep_us"] = s.get("prep_us")
        e["peer_step_us"] = p.get("step_us")
        e["peer_replay_us"] = p.get("replay_us")
        e["peer_plan_us"] = p.get("plan_us")
        e["specplan_step_per_floor"] = ratio(e["specplan_step_us"], floor)
        e["specplan_step_per_op_floor"] = ratio(e["specplan_step_us"], e["op_floor_us"])
        e["peer_step_per_floor"] = ratio(e["peer_step_us"], floor)
        e["specplan_per_peer_step"] = ratio(e["specplan_step_us"], e["peer_step_us"])
        e["specplan_per_peer_replay"] = ratio(e["specplan_replay_us"], e["peer_replay_us"])
        e["specplan_attn_us"] = s.get("attn_us")
        e["specplan_attn_tb_s"] = s.get("attn_tb_s")
        e["peer_attn_us"] = p.get("attn_us")
        e["peer_attn_tb_s"] = p.get("attn_tb_s")
        e["specplan_per_peer_attn"] = ratio(e["specplan_attn_us"], e["peer_attn_us"])
        base = re.sub(r"-8k$", "", e["model"])
        e["issue_peer_step_us"] = ISSUE_PEER.get((base, e["n"], e["prefix"], e["batch"]))
        out.append(e)
    return out


def main_table(rows):
    head = (
        "| model | N | L | B | floor µs | per-op floor µs | specplan step µs | peer step µs (plan + replay) | peer plan µs "
        "| specplan replay µs | peer replay µs | specplan/floor | specplan/per-op floor | peer/floor "
        "| specplan/peer step | specplan/peer replay |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for e in rows:
        lines.append(
            f"| {e['model']} | {fmt(e['n'])} | {e['prefix']} | {e['batch']} | {fmt(e['floor_us'])} "
            f"| {fmt(e.get('op_floor_us'))} "
            f"| {fmt(e['specplan_step_us'])} | {fmt(e['peer_step_us'])} | {fmt(e['peer_plan_us'])} "
            f"| {fmt(e['specplan_replay_us'])} | {fmt(e['peer_replay_us'])} "
            f"| {fmt(e['specplan_step_per_floor'], 2, '×')} | {fmt(e.get('specplan_step_per_op_floor'), 2, '×')} "
            f"| {fmt(e['peer_step_per_floor'], 2, '×')} "
            f"| {fmt(e['specplan_per_peer_step'], 2, '×')} | {fmt(e['specplan_per_peer_replay'], 2, '×')} |"
        )
    return head + "\n".join(lines) + "\n"


def floors_note(rows):
    """Markdown lines: how far the per-op floor lies above the floor, and the step against each."""
    both = [e for e in rows if e.get("op_floor_us") and e.get("floor_us") and e.get("specplan_step_us")]
    if not both:
        return []
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    apart = [e for e in both if e["op_floor_us"] > 1.02 * e["floor_us"]]
    beyond = [e for e in both if e["op_floor_us"] > 1.2 * e["floor_us"]]
    return [
        "Floor = the step's bytes over the copy ceiling or its FLOPs over the matmul ceiling, whichever is "
        "longer (every op's compute overlapped with another's memory traffic). Per-op floor = the same taken "
        "op by op and summed (each GEMM at the longer of its weight bytes and its FLOPs, the attention likewise): "
        "what a step running its ops one after another cannot beat. "
        f"The per-op floor is more than 2% above the floor at {len(apart)} of {len(both)} shapes "
        f"(up to {max(e['op_floor_us'] / e['floor_us'] for e in both):.2f}×), and more than 1.2× it at {len(beyond)}. "
        f"specplan's step: median {med([e['specplan_step_per_floor'] for e in both]):.2f}× the floor, "
        f"{med([e['specplan_step_per_op_floor'] for e in both]):.2f}× the per-op floor.",
        "",
    ]


def attn_table(rows):
    head = (
        "| model | Hq/Hkv | N | L | B | specplan attn µs | specplan TB/s | FlashInfer attn µs | FlashInfer TB/s | specplan/FlashInfer |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for e in rows:
        if e["specplan_attn_us"] is None and e["peer_attn_us"] is None:
            continue
        heads = e.get("heads", "")
        lines.append(
            f"| {e['model']} | {heads} | {fmt(e['n'])} | {e['prefix']} | {e['batch']} | {fmt(e['specplan_attn_us'])} "
            f"| {fmt(e['specplan_attn_tb_s'], 2)} | {fmt(e['peer_attn_us'])} | {fmt(e['peer_attn_tb_s'], 2)} "
            f"| {fmt(e['specplan_per_peer_attn'], 2, '×')} |"
        )
    return head + "\n".join(lines) + "\n"


def check_table(checks):
    head = (
        "| plan | inputs | b | hidden rel peer/specplan | peer/fp32 | specplan/fp32 | top-K p max abs Δ | top-K ids equal | ties | "
        "mismatched | K/V rel | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for c in checks:
        lines.append(
            f"| {c.get('plan')} | {c.get('inputs')} | {c.get('batch')} | {_e(c.get('hidden_rel_peer_vs_specplan'))} "
            f"| {_e(c.get('hidden_rel_peer_vs_f32'))} | {_e(c.get('hidden_rel_specplan_vs_f32'))} | {_e(c.get('prob_abs_max'))} "
            f"| {c.get('ids_equal')}/{c.get('ids_total')} | {c.get('ids_tied')} | {c.get('ids_mismatch')} "
            f"| {_e(c.get('kv_rel_peer_vs_specplan'))} | {'ok' if c.get('ok') else 'MISMATCH'} |"
        )
    return head + "\n".join(lines) + "\n"


def head_pair_section(rows, ceil):
    """Markdown lines comparing each HEAD_PAIRS EAGLE-3 model with its EAGLE-1 partner, or []."""
    by = {(e["model"], e["n"], e["prefix"], e["batch"]): e for e in rows}
    out = []
    for e3, e1 in HEAD_PAIRS:
        keys = sorted(k[1:] for k in by if k[0] == e3 and (e1,) + k[1:] in by)
        if not keys:
            continue
        out += [f"## EAGLE-3 draft head vs EAGLE-1 at equal shapes: {e3} vs {e1}", ""]
        a, b = by[(e3,) + keys[0]], by[(e1,) + keys[0]]
        wa = (a.get("peer") or {}).get("gemm_weight_bytes")
        wb = (b.get("peer") or {}).get("gemm_weight_bytes")
        va = (a.get("peer") or {}).get("lm_vocab", "?")
        vb = (b.get("peer") or {}).get("lm_vocab", "?")
        line = (f"What the smaller draft vocabulary buys: {e3}'s lm_head has {va} rows, {e1}'s {vb}; "
                "the EAGLE-3 head's fc (3·H_t columns) and q/k/v (2H columns) are wider.")
        if wa and wb:
            line += f" Weights every step reads whole: {wa / 1e6:.0f} MB vs {wb / 1e6:.0f} MB"
            if ceil and ceil.get("copy_bytes_per_s"):
                line += f" (Δ {(wb - wa) / ceil['copy_bytes_per_s'] * 1e6:.0f} µs at the measured copy ceiling)"
            line += "."
        out += [line, ""]
        out.append(f"| N | L | B | specplan {e1} µs | specplan {e3} µs | EAGLE-3/EAGLE-1 "
                   f"| peer {e1} µs | peer {e3} µs | EAGLE-3/EAGLE-1 |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        sd, pd = [], []
        for k in keys:
            x3, x1 = by[(e3,) + k], by[(e1,) + k]
            s3, s1, p3, p1 = x3["specplan_step_us"], x1["specplan_step_us"], x3["peer_step_us"], x1["peer_step_us"]
            if s3 is not None and s1 is not None:
                sd.append(s1 - s3)
            if p3 is not None and p1 is not None:
                pd.append(p1 - p3)
            out.append(f"| {fmt(k[0])} | {k[1]} | {k[2]} | {fmt(s1)} | {fmt(s3)} | {fmt(ratio(s3, s1), 2, '×')} "
                       f"| {fmt(p1)} | {fmt(p3)} | {fmt(ratio(p3, p1), 2, '×')} |")
        med = lambda v: sorted(v)[len(v) // 2] if v else None  # noqa: E731
        out += ["", f"Median step time saved by the EAGLE-3 head over {len(keys)} shapes: specplan "
                f"{fmt(med(sd), 1, ' µs')}, peer {fmt(med(pd), 1, ' µs')}.", ""]
    return out


def _e(x):
    return "—" if x is None else f"{x:.2e}"


# ---------------------------------------------------------------------------------------------
# SVG: one panel per (model, N, L): step µs vs bucket (categorical x), lines for specplan's
# step, the peer's step, the peer's replay and the floor.

SERIES = [
    ("specplan step", "specplan_step_us", "#1f77b4", ""),
    ("peer step (plan + replay)", "peer_step_us", "#d62728", ""),
    ("peer replay", "peer_replay_us", "#d62728", "5,4"),
    ("floor", "floor_us", "#555555", "2,3"),
]


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_max(v):
    if v <= 0:
        return 1.0
    import math

    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * e >= v:
            return m * e
    return 10 * e


def svg(rows, title):
    panels = {}
    for e in rows:
        panels.setdefault((e["model"], e["n"], e["prefix"]), []).append(e)
    keys = sorted(panels, key=lambda k: (k[0], k[2], k[1] or 0))
    if not keys:
        return '<svg xmlns="http://www.w3.org/2000/svg" width="400" height="60"><text x="10" y="30">no data</text></svg>\n'
    ns = sorted({k[1] or 0 for k in keys})
    groups = sorted({(k[0], k[2]) for k in keys})
    cols, nrows = len(ns), len(groups)
    pw, ph = 300, 210  # panel size
    ml, mt, gap = 60, 70, 40
    W = ml + cols * (pw + gap)
    H = mt + nrows * (ph + gap + 20) + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{ml}" y="22" font-size="15" font-weight="bold">{esc(title)}</text>',
    ]
    lx = ml
    for name, _, color, dash in SERIES:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{lx}" y1="42" x2="{lx + 28}" y2="42" stroke="{color}" stroke-width="2"{d}/>')
        out.append(f'<text x="{lx + 34}" y="46">{esc(name)}</text>')
        lx += 40 + 7 * len(name)
    for gi, (model, prefix) in enumerate(groups):
        for ci, n in enumerate(ns):
            k = (model, n if n else None, prefix)
            k = k if k in panels else (model, n, prefix)
            if k not in panels:
                continue
            pts = sorted(panels[k], key=lambda e: e["batch"])
            x0 = ml + ci * (pw + gap)
            y0 = mt + gi * (ph + gap + 20)
            bs = [e["batch"] for e in pts]
            vmax = max([e.get(s[1]) or 0 for e in pts for s in SERIES] + [1])
            top = nice_max(vmax * 1.05)
            px = lambda i: x0 + 20 + i * (pw - 40) / max(1, len(bs) - 1)  # noqa: E731
            py = lambda v: y0 + ph - v / top * ph  # noqa: E731
            out.append(f'<text x="{x0}" y="{y0 - 8}" font-weight="bold">{esc(model)}  N={n}  L={prefix}</text>')
            out.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
            for t in range(5):
                v = top * t / 4
                y = py(v)
                out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" stroke="#eee"/>')
                out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.0f}</text>')
            for i, b in enumerate(bs):
                out.append(f'<text x="{px(i):.1f}" y="{y0 + ph + 14}" text-anchor="middle">{b}</text>')
            out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 28}" text-anchor="middle" fill="#555">bucket B</text>')
            if ci == 0:
                out.append(
                    f'<text x="{x0 - 44}" y="{y0 + ph / 2}" transform="rotate(-90 {x0 - 44} {y0 + ph / 2})" '
                    f'text-anchor="middle" fill="#555">µs</text>'
                )
            for _, field, color, dash in SERIES:
                xy = [(px(i), py(e[field])) for i, e in enumerate(pts) if e.get(field) is not None]
                if not xy:
                    continue
                d = f' stroke-dasharray="{dash}"' if dash else ""
                if len(xy) > 1:
                    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
                    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{d}/>')
                for x, y in xy:
                    out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def memory_section(memory):
    """report.md lines: the engine-memory figure (gpucheck engine-memory), one row per load."""
    if memory is None:
        return []
    mib = lambda b: f"{b / (1 << 20):.1f}" if type(b) is int else "—"
    bound = memory.get("bound_bytes")
    md = ["## Engine memory (every bucket graphed, on caller memory)", "",
          "What a runner loaded onto the engine's own weights, K/V pool and page table adds to device memory "
          "(free memory before the load and with the runner alive), beside the parts the runtime knows; "
          f"bound {mib(bound)} MiB.", "",
          "| plan | buckets | added MiB | arena MiB | GEMM workspace MiB | rest MiB | within the bound |",
          "|---|---|---|---|---|---|---|"]
    for x in memory.get("load") or []:
        if not x:
            md.append("| (a load that failed: see gpucheck's log) | — | — | — | — | — | no |")
            continue
        a = x.get("added_memory") or {}
        total, arena, ws = a.get("measured_bytes"), a.get("arena_bytes"), a.get("workspace_bytes")
        rest = max(total - arena - ws, 0) if all(type(v) is int for v in (total, arena, ws)) else None
        ok = type(total) is int and type(bound) is int and total <= bound
        md.append(f"| {esc(str(x.get('name') or x.get('plan')))} | {x.get('buckets', '—')} | {mib(total)} | {mib(arena)} "
                  f"| {mib(ws)} | {mib(rest)} | {'yes' if ok else 'no'} |")
    return md + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specbench", help="specbench.json (specbench.txt beside it is the fallback)")
    ap.add_argument("--peer", nargs="*", default=[], help="peer JSON files (flashinfer_peer.py run --json)")
    ap.add_argument("--device", help="a text file describing the device (nvidia-smi output, date)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--previous", nargs="+", default=[],
                    help="previous full reports' report.json, newest first per GPU: the benchmark targets are judged "
                         "against the first one measured on this run's GPU (else the first given, not compared)")
    ap.add_argument("--engine-memory", help="gpucheck engine-memory's engine-memory.json: the memory figure, judged")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    ceil, spec_rows, spec_src = read_specbench(a.specbench)
    spec_doc = load_json(a.specbench) if a.specbench and os.path.exists(a.specbench) else None
    peers, notes = [], []
    for p in a.peer:
        try:
            peers.append(load_json(p))
        except Exception as e:  # a missing or cut file: report it, keep going
            notes.append(f"peer file {p}: {type(e).__name__}: {e}")
    rows = join(spec_rows, peers)
    device = ""
    if a.device and os.path.exists(a.device):
        with open(a.device) as f:
            device = f.read().strip()
    checks = [c for d in peers for c in d.get("checks", [])]
    errors = [x for d in peers for x in d.get("errors", [])]
    versions = sorted({f"torch {d.get('torch')}, FlashInfer {d.get('flashinfer', '?')}, CUDA {d.get('cuda')}" for d in peers})
    settings = next((d.get("settings") for d in peers if d.get("settings")), {})
    memory = None
    if a.engine_memory:
        # Unreadable: an error of the report ("not measured"), never a lost report.
        try:
            memory = load_json(a.engine_memory)
            problem = criteria.memory_problem(memory)
            if problem:
                raise ValueError(problem)
        except Exception as e:
            notes.append(f"engine memory {a.engine_memory}: {type(e).__name__}: {e}")
            memory = None
    judged = None
    if a.previous:
        # A previous report that cannot be read or judged is an error of the report, never a
        # lost report: the run's own tables are still written, and the verdict says "not met".
        try:
            judged = criteria.judge(rows, device, checks, same_gpu_previous(a.previous, device), memory)
        except Exception as e:
            notes.append(f"previous report {' '.join(a.previous)}: {type(e).__name__}: {e}")
            judged = criteria.judge(rows, device, checks, {"rows": [], "device": ""}, memory)

    md = ["# specplan vs PyTorch + FlashInfer vs the floor", ""]
    if device:
        md += ["```", device, "```", ""]
    if a.commit:
        md.append(f"Commit: `{a.commit}`.")
    if versions:
        md.append("Peer: " + "; ".join(versions) + ".")
    if ceil:
        md.append(
            f"Ceilings measured in the run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; floor = max(bytes / copy, FLOPs / matmul)."
        )
    if settings:
        md.append(
            f"Peer settings: backend {settings.get('backend')}, CUDA graph with uniform_q_len = N, plan() in every step, "
            f"pages {settings.get('pages')}; medians of {settings.get('runs')} runs after {settings.get('warmup')} warm-up"
            + (
                f"; replay and attention timed with L2 flushed ({settings['l2_flush_mb']} MiB written) before each run."
                if settings.get("l2_flush_mb")
                else "."
            )
        )
    md.append(
        "specplan: `specbench` (step = host wall clock of `step()` until done; replay = graph alone, CUDA events; "
        "medians of 100 after 10 warm-up). Peer step = host wall clock of the input copies + plan() + replay until done."
    )
    if spec_src and spec_src.endswith(".txt"):
        md.append(f"(specplan rows read from {os.path.basename(spec_src)}: specbench.json was missing.)")
    md.append("")
    if checks:
        ok = all(c.get("ok") for c in checks)
        md += ["## Equal outputs (same files, `specplan run --device cuda` vs the peer's graph)", ""]
        md.append("All checks passed." if ok else "**Some checks FAILED** (details in the peer logs).")
        md += ["", check_table(checks)]
    elif peers:
        md += ["## Equal outputs", "", "No check ran (see errors).", ""]
    if judged is not None:
        md += criteria.section(judged)
    md += ["## Draft-extend step", ""] + floors_note(rows) + [main_table(rows)]
    issue = [e for e in rows if e["issue_peer_step_us"] is not None]
    if issue:
        md += ["### The peer figures the benchmark issue quotes, beside this run", ""]
        md.append("| model | N | L | B | issue's peer µs | peer step µs here | specplan step µs here |")
        md.append("|---|---|---|---|---|---|---|")
        for e in issue:
            md.append(
                f"| {e['model']} | {e['n']} | {e['prefix']} | {e['batch']} | {e['issue_peer_step_us']} "
                f"| {fmt(e['peer_step_us'])} | {fmt(e['specplan_step_us'])} |"
            )
        md.append("")
    md += head_pair_section(rows, ceil)
    md += breakdown_section(spec_doc, ceil)
    md += memory_section(memory)
    md += ["## Attention alone", "", "Useful bytes: K/V read (L + N rows), q read, o written, every layer.", ""]
    targets = [e for e in rows if e["n"] == 4 and (e["batch"], e["prefix"]) in ((32, 4096), (1, 1024))]
    if targets:
        md += ["The issue's attention shapes (T = N = 4; targets: ≥ 4.3 TB/s at B32 L4096, ≤ 10 µs at B1 L1024;",
               "FlashInfer as the issue quotes it: 512 µs = 4.21 TB/s at MHA B32 L4096, 18.6 µs at B1 L1024):", "",
               attn_table(targets), "All shapes:", ""]
    md += [attn_table(rows)]
    if errors or notes:
        md += ["## Errors", ""] + [f"- {esc(x)}" for x in errors + notes] + [""]
    md += ["![step time vs bucket](report.svg)", ""]

    os.makedirs(a.out, exist_ok=True)
    outs = {name: os.path.join(a.out, name) for name in ("report.md", "report.json", "report.svg")}
    for path in outs.values():
        # Never write through a FIFO or device node (an open would block or write into it).
        if os.path.lexists(path) and not os.path.isfile(path):
            print(f"report.py: {path} exists and is not a regular file: refusing to write it", file=sys.stderr)
            return 2
    write_file(outs["report.md"], "\n".join(md))
    doc = {
        "device": device,
        "commit": a.commit,
        "ceilings": ceil,
        "peer_versions": versions,
        "peer_settings": settings,
        "checks": checks,
        "errors": errors + notes,
        "rows": [{k: v for k, v in e.items() if k not in ("specplan", "peer")} for e in rows],
    }
    if memory is not None:
        doc["engine_memory"] = memory
    if judged is not None:
        doc["criteria"] = judged
    write_file(outs["report.json"], json.dumps(doc, indent=1) + "\n")
    write_file(outs["report.svg"], svg(rows, "draft-extend step vs bucket: specplan, PyTorch + FlashInfer, floor"))

    # The short table last.
    print(f"{'plan':<26} {'L':>5} {'B':>3} {'floor':>8} {'op floor':>8} {'specplan':>9} {'peer':>9} {'peer rpl':>9} "
          f"{'sp/peer':>8}")
    for e in rows:
        print(
            f"{e['plan']:<26} {e['prefix']:>5} {e['batch']:>3} {fmt(e['floor_us']):>8} {fmt(e.get('op_floor_us')):>8} "
            f"{fmt(e['specplan_step_us']):>9} {fmt(e['peer_step_us']):>9} {fmt(e['peer_replay_us']):>9} "
            f"{fmt(e['specplan_per_peer_step'], 2, 'x'):>8}"
        )
    if checks:
        bad = [c for c in checks if not c.get("ok")]
        print(f"equal-output checks: {len(checks) - len(bad)}/{len(checks)} passed")
    for x in errors + notes:
        print("error:", x)
    print(f"wrote {os.path.join(a.out, 'report.md')}, report.json, report.svg")
    if judged is not None:
        for line in criteria.summary(judged):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
