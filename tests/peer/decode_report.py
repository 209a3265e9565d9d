#!/usr/bin/env python3
"""The draft-decode benchmark table: specbench's draft-decode rows (specbench.json "decode")
joined with the peer's (decode_peer.py bench JSONs) by (plan, phase, B, L): specplan's replay,
the peer's replay and whole step (its per-step indices and plans included), specplan's replay
against both and against the floor; then the whole draft per decoding step, where specbench and
the peer also timed the plan's draft-extend step (`decode_peer.py --with-extend`): draft-extend's
replay plus the draft-decode tier's, beside the peer's two replays and its two whole steps.

  decode_report.py SPECBENCH.json OUT.md PEER.json [PEER.json ...]
"""
import json
import sys


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sb = json.load(open(sys.argv[1]))
    spec = sb.get("decode", [])
    spec_ext = {(r["plan"], r["batch"], r["prefix"]): r for r in sb.get("rows", [])}
    peer, peer_ext = {}, {}
    for path in sys.argv[3:]:
        try:
            rows = json.load(open(path)).get("decode", [])
        except (OSError, ValueError) as e:
            print(f"decode_report: {path}: {e}")
            continue
        for r in rows:
            peer[(r["plan"], r["phase"], r["batch"], r["prefix"])] = r
        for r in json.load(open(path)).get("extend", []):
            peer_ext[(r["plan"], r["batch"], r["prefix"])] = r
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
    whole = [
        "",
        "The whole draft per decoding step (draft-extend + draft decode):",
        "",
        "| plan | phase | K | B | L | specplan extend + decode µs | peer replays µs | peer steps µs | vs peer replays "
        "| vs peer steps | floor µs | /floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in spec:
        key = (r["plan"], r["batch"], r["prefix"])
        e, pe, pd = spec_ext.get(key), peer_ext.get(key), peer.get((r["plan"], r["phase"], r["batch"], r["prefix"]))
        if not (e and pe and pd):
            continue
        ours = e["replay_us"] + r["replay_us"]
        theirs_r = pe["replay_us"] + pd["replay_us"]
        theirs_s = pe["step_us"] + pd["step_us"]
        floor = e["floor_us"] + r["floor_us"]
        whole.append(
            f"| {r['plan']} | {r['phase']} | {r['topk']} | {r['batch']} | {r['prefix']} | "
            f"{e['replay_us']:.1f} + {r['replay_us']:.1f} = {ours:.1f} | {theirs_r:.1f} | {theirs_s:.1f} | "
            f"{ours / theirs_r:.2f}× | {ours / theirs_s:.2f}× | {floor:.1f} | {ours / floor:.2f}× |"
        )
    if len(whole) > 6:
        lines += whole
    text = "\n".join(lines) + "\n"
    with open(sys.argv[2], "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
