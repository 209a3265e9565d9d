#!/usr/bin/env python3
"""Summarizes compute-sanitizer logs: per log, the tool's error count split by kernel
(specplan's entries vs everything else, e.g. cuBLAS), and the first report of each kind.
Reports with an address are traced to the arena buffer holding it and what writes that
buffer, from the `map NAME START END WRITER` lines `gpucheck sanitize` prints before each
bucket's steps (a report is traced with the map printed last before it).

usage: sanitize_summary.py 'entry1|entry2|...' LOG...
"""
import re
import sys

REPORT = re.compile(r"^=========\s+(Invalid|Uninitialized|Error|Race|Barrier|Warning|Hazard|Program hit)")
MAP = re.compile(r"^map (\S+) (0x[0-9a-f]+) (0x[0-9a-f]+) (\S+)")


def kernel_of(block):
    """The kernel a report block names (`at <name>+0x..` or `in kernel <name>`)."""
    for line in block:
        m = re.search(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>, ]*?)(?:\+0x[0-9a-f]+|\(|$)", line)
        if m and "cuda" not in m.group(1).lower():
            return m.group(1).strip()
        m = re.search(r"in kernel ([\w]+)", line)
        if m:
            return m.group(1)
    return "?"


def parse(text):
    """Report blocks, each with the arena map in force when it was printed."""
    blocks, cur, ranges, in_map = [], None, [], False
    for line in text:
        m = MAP.match(line)
        if m:
            if not in_map:
                ranges = []
            in_map = True
            ranges.append((int(m.group(2), 16), int(m.group(3), 16), m.group(1), m.group(4)))
            cur = None
            continue
        in_map = False
        if REPORT.match(line):
            cur = [line]
            blocks.append((cur, ranges))
        elif cur is not None and line.startswith("=========     "):
            cur.append(line)
        else:
            cur = None
    return blocks


def main():
    ours = set(sys.argv[1].split("|"))
    total_bad = 0
    for path in sys.argv[2:]:
        try:
            text = open(path, errors="replace").read().splitlines()
        except OSError as e:
            print(f"{path}: unreadable ({e})")
            continue
        summary = next((l for l in text if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l), "no summary line")
        per, first, traced = {}, {}, {}
        for b, ranges in parse(text):
            k = kernel_of(b)
            kind = re.sub(r"^=+\s*", "", b[0]).split(" of size")[0][:80]
            per[(k in ours, k)] = per.get((k in ours, k), 0) + 1
            first.setdefault(k, kind)
            addr = next((int(m.group(1), 16) for l in b for m in [re.search(r"Address (0x[0-9a-f]+)", l)] if m), None)
            if addr is not None:
                hit = [(n, w) for lo, hi, n, w in ranges if lo <= addr < hi]
                key = (k, hit[-1] if hit else ("memory outside the arena", "-"))
                traced[key] = traced.get(key, 0) + 1
        refused = any("refus" in l or "not supported" in l.lower() for l in text[:20])
        print(f"{path.split('/')[-1]}: {summary.strip('= ')}{' (sanitizer refused the device)' if refused else ''}")
        for (mine, k), n in sorted(per.items()):
            who = "specplan" if mine else "vendor"
            print(f"    {who:8} {k}: {n} printed report(s), e.g. {first[k]}")
            total_bad += n if mine else 0
        for (k, (buf, writer)), n in sorted(traced.items()):
            print(f"        {k} at {buf} (written by {writer}): {n}")
    print(f"specplan kernels: {total_bad} printed report(s) in all")


if __name__ == "__main__":
    main()
