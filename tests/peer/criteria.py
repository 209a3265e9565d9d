"""The benchmark targets judged on one benchmark run, against the previous full report.

The targets are met when, in one `.ci/gpu bench` over the same shapes: every step is
≤ 1.2× the floor (≤ 1.1× at B 1), no shape is slower than in the previous report, the
equal-output checks pass, and every engine-memory load of the run (`gpucheck engine-memory`:
a plan with all its buckets graphed on caller memory) adds at most its bound (64 MiB). (The
numerics targets are asserted by gpucheck's checks, not measured here.) report.py calls
`judge` with the joined rows and writes `section` into report.md, `judgement` into
report.json and `summary` last on stdout, so a run says itself whether it meets them.
Python standard library only.

A run on another GPU than the previous report's (an H100 against the H200's report, say) is
judged against the floor, whose ceilings it measured itself, but not against the previous
step times: those would compare machines, not trees.
"""

FLOOR_TARGET = 1.2
FLOOR_TARGET_B1 = 1.1


def gpu_name(device_text):
    """The GPU's name from device.txt (nvidia-smi's csv: a header line, then 'NAME, driver, ...')."""
    for line in (device_text or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 2 and cells[0] and not cells[0].startswith("name"):
            return cells[0]
    return None


def _key(e):
    return (e["model"], e["n"], e["prefix"], e["batch"])


MIB = 1 << 20


def memory_problem(memory):
    """Why engine-memory.json's content cannot be judged (its shape is not what `gpucheck
    engine-memory` writes), or None."""
    if not isinstance(memory, dict):
        return "not a JSON object"
    if type(memory.get("bound_bytes")) is not int:
        return "bound_bytes is not an integer"
    loads = memory.get("load")
    if not isinstance(loads, list):
        return "load is not a list"
    for i, x in enumerate(loads):
        if x is None:
            continue
        if not isinstance(x, dict) or not isinstance(x.get("added_memory"), dict):
            return f"load[{i}] is neither null nor an object with an added_memory object"
    return None


def judge_memory(memory):
    """engine-memory.json (a dict: "bound_bytes" and one "load" entry per plan, null where the
    load failed) judged: each load's added bytes against the bound. None (no file, or one
    whose shape `memory_problem` refuses) is "not measured", which never meets the targets."""
    if memory is None or memory_problem(memory) is not None:
        return None
    bound = memory.get("bound_bytes")
    loads = []
    for x in memory.get("load") or []:
        added = (x or {}).get("added_memory") or {}
        b = added.get("measured_bytes")
        loads.append({
            "plan": (x or {}).get("name") or (x or {}).get("plan"),
            "buckets": (x or {}).get("buckets"),
            "added_bytes": b,
            "arena_bytes": added.get("arena_bytes"),
            "workspace_bytes": added.get("workspace_bytes"),
            "met": type(b) is int and type(bound) is int and b <= bound,
        })
    return {"bound_bytes": bound, "loads": loads, "met": bool(loads) and all(x["met"] for x in loads)}


def judge(rows, device_text, checks, previous, memory=None):
    """The criteria over `rows` (report.py's joined rows); `previous` is the previous report.json
    as a dict, or None; `memory` the run's engine-memory.json as a dict, or None. Returns a dict
    that report.json keeps as "criteria"."""
    shapes = []
    for e in rows:
        step, floor = e.get("specplan_step_us"), e.get("floor_us")
        if step is None or not floor:
            continue
        target = FLOOR_TARGET_B1 if e["batch"] == 1 else FLOOR_TARGET
        shapes.append({
            "model": e["model"], "n": e["n"], "prefix": e["prefix"], "batch": e["batch"],
            "step_us": step, "per_floor": step / floor, "target": target, "floor_met": step / floor <= target,
        })
    out = {
        "shapes": len(shapes),
        "floor_met": sum(s["floor_met"] for s in shapes),
        "b1_shapes": sum(s["batch"] == 1 for s in shapes),
        "b1_floor_met": sum(s["floor_met"] for s in shapes if s["batch"] == 1),
        "checks": len(checks),
        "checks_passed": sum(bool(c.get("ok")) for c in checks),
        "previous": None,
        "memory": judge_memory(memory),
        "rows": shapes,
    }
    if previous is not None:
        here, there = gpu_name(device_text), gpu_name(previous.get("device", ""))
        prev = {_key(r): r for r in previous.get("rows", []) if r.get("specplan_step_us")}
        cmp = {
            "commit": previous.get("commit"), "gpu": there, "this_gpu": here,
            "comparable": bool(here) and here == there,
            "missing": sorted("%s N%s L%s B%s" % k for k in prev if k not in {_key(s) for s in shapes}),
        }
        if cmp["comparable"]:
            for s in shapes:
                p = prev.get(_key(s))
                s["previous_step_us"] = p["specplan_step_us"] if p else None
                s["per_previous"] = s["step_us"] / p["specplan_step_us"] if p else None
            ratios = [s["per_previous"] for s in shapes if s.get("per_previous") is not None]
            cmp["compared"] = len(ratios)
            cmp["slower"] = sum(r > 1.0 for r in ratios)
            cmp["slower_1pct"] = sum(r > 1.01 for r in ratios)
            cmp["worst"] = max(ratios) if ratios else None
            cmp["median"] = sorted(ratios)[len(ratios) // 2] if ratios else None
        out["previous"] = cmp
    p = out["previous"]
    out["met"] = bool(
        shapes
        and out["floor_met"] == len(shapes)
        and out["checks"] > 0
        and out["checks_passed"] == out["checks"]
        and p is not None
        and p["comparable"]
        and not p["missing"]
        and p.get("slower") == 0
        and out["memory"] is not None
        and out["memory"]["met"]
    )
    return out


def summary(j):
    """Short lines for the end of the printed table."""
    lines = [
        f"floor targets: {j['floor_met']}/{j['shapes']} shapes within 1.2x (B 1: {j['b1_floor_met']}/{j['b1_shapes']} within 1.1x)",
        f"equal-output checks: {j['checks_passed']}/{j['checks']} passed",
    ]
    p = j["previous"]
    if p is None:
        lines.append("previous report: none given (no shape compared)")
    elif not p["comparable"]:
        lines.append(f"previous report ({p['gpu']}) not compared: this run is on {p['this_gpu']}")
    else:
        lines.append(
            f"against the previous report ({str(p['commit'])[:9]}): {p['slower']}/{p['compared']} shapes slower "
            f"({p['slower_1pct']} by more than 1%), median {p['median']:.3f}x, worst {p['worst']:.3f}x"
            + (f"; missing here: {len(p['missing'])}" if p["missing"] else "")
        )
    m = j.get("memory")
    if m is None:
        lines.append("engine memory: not measured in this run")
    else:
        bound = m["bound_bytes"] / MIB if type(m["bound_bytes"]) is int else None
        each = ", ".join(
            (f"{x['plan']} ({x['buckets']} buckets) " if x["plan"] else "a plan whose ")
            + (f"{x['added_bytes'] / MIB:.1f} MiB" if type(x["added_bytes"]) is int else "load failed")
            for x in m["loads"]
        ) or "no load"
        lines.append(
            f"engine memory: {sum(x['met'] for x in m['loads'])}/{len(m['loads'])} loads within "
            + (f"{bound:.0f} MiB" if bound is not None else "a bound the file does not give")
            + f" ({each})"
        )
    lines.append("benchmark targets: " + ("MET" if j["met"] else "not met"))
    return lines


def _x(v):
    return "—" if v is None else f"{v:.3f}×"


def section(j):
    """report.md lines: the verdict, then every shape that misses a target."""
    md = ["## The benchmark targets in this run", ""]
    md += [f"- {line}" for line in summary(j)]
    md += ["", "(The numerics targets are asserted by gpucheck's checks, not here. Engine memory: each plan "
           "loaded onto caller memory with every bucket graphed, the device memory it adds, by `gpucheck "
           "engine-memory` in this run.)", ""]
    miss = [s for s in j["rows"] if not s["floor_met"] or (s.get("per_previous") or 0) > 1.0]
    if miss:
        md += ["Shapes that miss a target (the floor's, or slower than the previous report):", "",
               "| model | N | L | B | step µs | step/floor | target | previous µs | step/previous |",
               "|---|---|---|---|---|---|---|---|---|"]
        for s in miss:
            md.append(
                f"| {s['model']} | {s['n']} | {s['prefix']} | {s['batch']} | {s['step_us']:.1f} "
                f"| {s['per_floor']:.2f}× | {s['target']:.1f}× "
                f"| {'—' if s.get('previous_step_us') is None else '%.1f' % s['previous_step_us']} "
                f"| {_x(s.get('per_previous'))} |"
            )
        md.append("")
    return md
