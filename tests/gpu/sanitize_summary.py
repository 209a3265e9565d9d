#!/usr/bin/env python3
"""Summarizes compute-sanitizer logs: per log, the tool's error count split by kernel
(specplan's entries vs everything else, e.g. cuBLAS), and the first report of each kind.

usage: sanitize_summary.py 'entry1|entry2|...' LOG...
"""
import re
import sys


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
        blocks, cur = [], None
        for line in text:
            if re.match(r"^=========\s+(Invalid|Uninitialized|Error|Race|Barrier|Warning|Hazard|Program hit)", line):
                cur = [line]
                blocks.append(cur)
            elif cur is not None and line.startswith("=========     "):
                cur.append(line)
            else:
                cur = None
        per = {}
        first = {}
        for b in blocks:
            k = kernel_of(b)
            kind = re.sub(r"^=+\s*", "", b[0]).split(" of size")[0][:80]
            per[(k in ours, k)] = per.get((k in ours, k), 0) + 1
            first.setdefault(k, kind)
        refused = any("refus" in l or "not supported" in l.lower() for l in text[:20])
        print(f"{path.split('/')[-1]}: {summary.strip('= ')}{' (sanitizer refused the device)' if refused else ''}")
        for (mine, k), n in sorted(per.items()):
            who = "specplan" if mine else "vendor"
            print(f"    {who:8} {k}: {n} report(s), e.g. {first[k]}")
            total_bad += n if mine else 0
    print(f"specplan kernels: {total_bad} report(s) in all")


if __name__ == "__main__":
    main()
