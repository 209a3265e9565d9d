#!/usr/bin/env python3
"""The draft-decode benchmark table: specbench's draft-decode rows (specbench.json "decode")
joined with the peer's (decode_peer.py bench JSONs) by (plan, phase, B, L): specplan's replay,
the peer's replay and whole step (its per-step indices and plans included), specplan's replay
against both and against the floor.

  decode_report.py SPECBENCH.json OUT.md PEER.json [PEER.json ...]
"""
import json
import sys


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    spec = json.load(open(sys.argv[1])).get("decode", [])
    peer = {}
    for path in sys.argv[3:]:
        try:
            rows = json.load(open(path)).get("decode", [])
        except (OSError, ValueError) as e:
            print(f"decode_report: {path}: {e}")
            continue
        for r in rows:
            peer[(r["plan"], r["phase"], r["batch"], r["prefix"])] = r
    lines = [
        "| plan | phase | K | B | L | specplan replay µs | peer replay µs | peer step µs | vs peer replay | vs peer step "
        "| floor µs | replay/floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in spec:
        p = peer.get((r["plan"], r["phase"], r["batch"], r["prefix"]))
        pr = f"{p['replay_us']:.1f}" if p else "—"
        ps = f"{p['step_us']:.1f}" if p else "—"
        vr = f"{r['replay_us'] / p['replay_us']:.2f}×" if p else "—"
        vs = f"{r['replay_us'] / p['step_us']:.2f}×" if p else "—"
        lines.append(
            f"| {r['plan']} | {r['phase']} | {r['topk']} | {r['batch']} | {r['prefix']} | {r['replay_us']:.1f} | {pr} | "
            f"{ps} | {vr} | {vs} | {r['floor_us']:.1f} | {r['replay_us'] / r['floor_us']:.2f}× |"
        )
    text = "\n".join(lines) + "\n"
    with open(sys.argv[2], "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
