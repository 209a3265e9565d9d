#!/usr/bin/env python3
"""Kernel durations from an `ncu --csv --metrics gpu__time_duration.sum` log: one line per
(kernel, grid, block), in the order first seen, with the launch count and the median.

    ncu_table.py NCU.csv

What `.ci/gpu kernels` prints: the time each of our kernels takes alone (ncu serializes
launches and flushes caches before each), the part of a step that is kernel work rather than
launch gaps. Exit status 2 when the file holds no kernel rows.
"""
import csv
import io
import statistics
import sys


def rows(text):
    # ncu prints its own notes before the CSV; the table starts at the header line.
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return []
    body = "\n".join(l for l in lines[start:] if l.startswith('"'))
    return list(csv.DictReader(io.StringIO(body)))


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().split("\n")[2].strip(), file=sys.stderr)
        return 2
    try:
        with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
            table = rows(f.read())
    except OSError as e:
        print(f"ncu_table: {e}", file=sys.stderr)
        return 2
    seen = {}
    for r in table:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        key = (r["Kernel Name"].split("(")[0], r["Grid Size"], r["Block Size"])
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1000.0 if unit.startswith("n") else v if unit.startswith("u") else v * 1000.0
        seen.setdefault(key, []).append(us)
    if not seen:
        print("ncu_table: no kernel durations in the file", file=sys.stderr)
        return 2
    print(f"{'kernel':<22} {'grid':<16} {'block':<14} {'runs':>5} {'median µs':>10}")
    for (name, grid, block), v in seen.items():
        print(f"{name:<22} {grid:<16} {block:<14} {len(v):>5} {statistics.median(v):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
