#!/usr/bin/env python3
"""What ptxas made of a plan's kernel entries, read from the CUBINs the plan carries: registers
a thread, spill instructions, the instruction count, and every loop of 100 or more
instructions with its most frequent opcodes.

    sass_stats.py NVDISASM PLAN [ENTRY...] [--dump DIR]

NVDISASM is the disassembler (`.ci/sass` provisions NVIDIA's pip wheel and calls this). With
no ENTRY, every entry of every CUBIN is listed. `--dump DIR` also writes each matching
entry's disassembly to DIR/ENTRY.sass.

No GPU is needed. It answers the questions a profile otherwise costs device time for:
- did a change cut the key loop's instructions;
- did a launch bound push ptxas into spills;
- how many registers does an entry take, and so how many CTAs fit an SM.

Exit status 2 on bad arguments or a plan with no CUBIN, 1 when a named entry is in none.
"""
import collections
import os
import re
import struct
import subprocess
import sys

EM_CUDA = 190
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 4


def cubins(data):
    """Every CUDA ELF image in the plan's bytes (the plan stores them verbatim)."""
    out = []
    for m in re.finditer(b"\x7fELF", data):
        o = m.start()
        if len(data) < o + 64 or data[o + 4] != 2:  # ELF64 only
            continue
        if struct.unpack_from("<H", data, o + 0x12)[0] != EM_CUDA:
            continue
        phoff, shoff = struct.unpack_from("<QQ", data, o + 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, o + 0x36)
        size = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
        if o + size <= len(data):
            out.append(data[o : o + size])
    return out


def sections(elf):
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link = struct.unpack_from("<IIQQQQI", elf, shoff + i * shentsize)
        raw.append((name, typ, off, size, link))
    strtab = raw[shstrndx][2]

    def cstr(base, at):
        return elf[base + at : elf.index(b"\0", base + at)].decode()

    return [(cstr(strtab, n), typ, off, size, link) for n, typ, off, size, link in raw], cstr


def registers(elf):
    """Entry name -> registers a thread, from `.nv.info`'s REGCOUNT attributes."""
    secs, cstr = sections(elf)
    symtab = next((s for s in secs if s[1] == 2), None)
    if symtab is None:
        return {}
    names = []
    symstr = secs[symtab[4]][2]
    for k in range(symtab[3] // 24):
        names.append(cstr(symstr, struct.unpack_from("<I", elf, symtab[2] + k * 24)[0]))
    regs = {}
    for name, _typ, off, size, _link in secs:
        if name != ".nv.info":
            continue
        p, end = off, off + size
        while p + 4 <= end:
            fmt, attr = elf[p], elf[p + 1]
            if fmt == EIFMT_SVAL:
                sz = struct.unpack_from("<H", elf, p + 2)[0]
                if attr == EIATTR_REGCOUNT and sz >= 8:
                    sym, count = struct.unpack_from("<II", elf, p + 4)
                    if sym < len(names):
                        regs[names[sym]] = count
                p += 4 + sz
            else:
                p += 4
    return regs


def entry_sass(text, entry):
    """The instructions (and labels, as 'LABEL name') of one entry's `.text` section."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith(".text."):
            inside = line.strip() == f".text.{entry}:"
            continue
        if inside and "--------------------- .text." in line:
            break
        if not inside:
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            out.append("LABEL " + m.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(m.group(1))
    return out


def opcode(ins):
    parts = ins.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def report(entry, regs, ins):
    body = [x for x in ins if not x.startswith("LABEL ")]
    spills = sum(1 for x in body if opcode(x).startswith(("STL", "LDL")))
    print(f"{entry}: {regs if regs is not None else '?'} registers, {len(body)} instructions, {spills} spill")
    labels = {x[6:]: i for i, x in enumerate(ins) if x.startswith("LABEL ")}
    for i, x in enumerate(ins):
        m = re.search(r"BRA.*?(\.L_x_\d+)", x)
        if not m or m.group(1) not in labels or labels[m.group(1)] > i:
            continue
        loop = [y for y in ins[labels[m.group(1)] : i + 1] if not y.startswith("LABEL ")]
        if len(loop) < 100:
            continue
        top = collections.Counter(opcode(y) for y in loop).most_common(8)
        loop_spills = sum(1 for y in loop if opcode(y).startswith(("STL", "LDL")))
        ops = ", ".join(f"{k} {v}" for k, v in top)
        print(f"  loop of {len(loop)} instructions ({loop_spills} spill): {ops}")


def main(argv):
    dump = None
    if "--dump" in argv:
        i = argv.index("--dump")
        if i + 1 >= len(argv):
            print("--dump needs a folder", file=sys.stderr)
            return 2
        dump = argv[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    if len(argv) < 3:
        print(__doc__.strip().split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    nvdisasm, plan, wanted = argv[1], argv[2], argv[3:]
    with open(plan, "rb") as f:
        images = cubins(f.read())
    if not images:
        print(f"{plan}: no CUBIN in the plan", file=sys.stderr)
        return 2
    if dump:
        os.makedirs(dump, exist_ok=True)
    found = set()
    for n, elf in enumerate(images):
        entries = sorted(set(re.findall(rb"\.text\.([A-Za-z_][A-Za-z0-9_]*)\x00", elf)))
        entries = [e.decode() for e in entries]
        pick = [e for e in entries if not wanted or e in wanted and e not in found]
        if not pick:
            continue
        path = f"/tmp/sass_stats_{os.getpid()}_{n}.cubin"
        with open(path, "wb") as f:
            f.write(elf)
        try:
            text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"nvdisasm failed on CUBIN {n}: {e}", file=sys.stderr)
            return 2
        finally:
            os.remove(path)
        regs = registers(elf)
        for e in pick:
            ins = entry_sass(text, e)
            report(e, regs.get(e), ins)
            found.add(e)
            if dump:
                with open(os.path.join(dump, f"{e}.sass"), "w") as f:
                    f.write("\n".join(ins) + "\n")
    missing = [e for e in wanted if e not in found]
    if missing:
        print(f"not in {plan}: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
