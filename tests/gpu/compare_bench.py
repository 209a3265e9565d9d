#!/usr/bin/env python3
"""Step times of a specbench run against a baseline run: one line per shape both ran, the
ratio of step time (full_us) and of attention alone, and a verdict against a tolerance.

    compare_bench.py BASELINE.json NEW.json [--tolerance 0.03] [--metric full_us|replay_us]

The metric compared is the step (full_us: host prep + replay, the default) or the replay alone
(replay_us: the GPU's time, less noisy when both runs are on one machine, as `.ci/gpu ab` has).

Both files are specbench.json (the current object form, or the older list form whose first
entry is the ceilings). Exit status: 0 when every shared shape's step is within the
tolerance above the baseline (faster is always fine), 1 when one is not, 2 on bad input
(unreadable files, no shape in common).
"""
import argparse
import json
import statistics
import sys


def rows(path):
    with open(path) as f:
        d = json.load(f)
    if isinstance(d, list):  # older runs: [ceilings, row, row, ...]
        d = {"rows": d[1:]}
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
        raise ValueError(f"{path}: not a specbench.json (no rows)")
    out = {}
    for r in d["rows"]:
        try:
            out[(r["plan"], int(r["batch"]), int(r["prefix"]))] = r
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: a row without plan/batch/prefix ({e})") from None
    return out


def compare(base, new, tol, metric="full_us"):
    """Lines of the table and whether every shape is within tolerance."""
    keys = sorted(set(base) & set(new))
    name = "step" if metric == "full_us" else "replay"
    lines = [f"plan                            B     L   base µs    new µs {name:>6}   attn", ""]
    ok = True
    ratios = []
    for k in keys:
        b, n = base[k], new[k]
        r = n[metric] / b[metric]
        ra = n["attn_us"] / b["attn_us"] if b.get("attn_us") else float("nan")
        ratios.append(r)
        bad = r > 1.0 + tol
        ok &= not bad
        lines.append(
            f"{k[0]:<30} {k[1]:>3} {k[2]:>5} {b[metric]:>9.1f} {n[metric]:>9.1f} {r:>6.3f} {ra:>6.3f}"
            + ("  SLOWER" if bad else "")
        )
    del lines[1]
    if ratios:
        lines.append(
            f"{len(ratios)} shapes: {name} ratio median {statistics.median(ratios):.3f}, "
            f"max {max(ratios):.3f} (tolerance +{tol:.0%})"
        )
    return lines, ok, len(keys)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("baseline")
    ap.add_argument("new")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--metric", choices=["full_us", "replay_us"], default="full_us")
    a = ap.parse_args()
    try:
        base, new = rows(a.baseline), rows(a.new)
    except (OSError, ValueError) as e:
        print(f"compare_bench: {e}", file=sys.stderr)
        return 2
    lines, ok, n = compare(base, new, a.tolerance, a.metric)
    if n == 0:
        print("compare_bench: the two runs have no shape in common", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
