#!/usr/bin/env python3
"""What limits a kernel, from an ncu report (`ncu --set full --export R`): per profiled
launch, the section metrics that say whether it is bound by memory, issue or latency, and
its warp stall reasons ranked.

    ncu_details.py DETAILS.csv RAW.csv

DETAILS.csv is `ncu --import R.ncu-rep --page details --csv`, RAW.csv `ncu --import
R.ncu-rep --page raw --csv`. What `.ci/gpu profile` prints. Exit status 2 when either file
holds no launch.
"""
import csv
import io
import sys

# Section metrics, in the order printed (names as ncu's details page spells them).
WANT = [
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "L2 Hit Rate",
    "Compute (SM) Throughput",
    "Executed Ipc Active",
    "Registers Per Thread",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Warp Cycles Per Issued Instruction",
    "Eligible Warps Per Scheduler",
    "No Eligible",
]
STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def table(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    # ncu prints its own notes before the CSV; the table starts at the header line.
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return []
    body = "\n".join(l for l in lines[start:] if l.startswith('"'))
    return list(csv.DictReader(io.StringIO(body)))


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().split("\n")[4].strip(), file=sys.stderr)
        return 2
    try:
        details, raw = table(sys.argv[1]), table(sys.argv[2])
    except OSError as e:
        print(f"ncu_details: {e}", file=sys.stderr)
        return 2
    launches = {}
    for r in details:
        key = r.get("ID")
        if key is None:
            continue
        d = launches.setdefault(key, {"name": r.get("Kernel Name", "?").split("(")[0],
                                      "grid": r.get("Grid Size", "?"), "block": r.get("Block Size", "?"),
                                      "metrics": {}})
        name = r.get("Metric Name")
        if name in WANT and name not in d["metrics"]:
            d["metrics"][name] = f"{r.get('Metric Value', '?')} {r.get('Metric Unit', '')}".strip()
    if not launches:
        print("ncu_details: no launch in the details file", file=sys.stderr)
        return 2
    # The raw page: one row per launch (after ncu's unit row), a column per metric.
    stalls = {}
    for r in raw:
        key = r.get("ID")
        if key is None or number(key) is None:
            continue
        ranked = []
        for col, v in r.items():
            if col and col.startswith(STALL) and col.endswith(STALL_END):
                x = number(v)
                if x is not None and x > 0:
                    ranked.append((x, col[len(STALL):-len(STALL_END)]))
        stalls[key] = sorted(ranked, reverse=True)
    for key, d in launches.items():
        print(f"== launch {key}: {d['name']} grid {d['grid']} block {d['block']}")
        for name in WANT:
            if name in d["metrics"]:
                print(f"   {name:<36} {d['metrics'][name]}")
        top = stalls.get(key, [])
        if top:
            total = sum(x for x, _ in top)
            print("   stalls (warps per issue, share): " + ", ".join(
                f"{reason} {x:.2f} ({100 * x / total:.0f}%)" for x, reason in top[:6]))
        else:
            print("   stalls: none in the raw page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
