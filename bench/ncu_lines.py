#!/usr/bin/env python3
"""Per source line: a kernel's executed instructions and stall samples, from ncu's per-SASS CSV taken on
the GPU host and the disassembly (with line info) of the same object built here.

On the GPU host (a -lineinfo build is not needed there; the same compiler and flags are):
    ncu --section SourceCounters -o rep ...; ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv
Here, for the object that holds the kernel (the build's nvcc command for FILE.cu with -lineinfo, -cubin and
code=sm_90a), then:
    nvdisasm -gi FILE.cubin > FILE.sass
    python3 bench/ncu_lines.py FILE.sass k.csv KERNEL_NAME [TOP]
Rows are joined by instruction offset from the kernel's first address, and the opcodes compared (the
count of mismatches is printed: anything but 0 means the objects differ). Inlined code is attributed to
the first .cu line of its inline chain (the call site in the kernel's own file), so a helper's cost
shows where it is called.

With "-" for the CSV: the static instructions of each line and their commonest opcodes, from the
disassembly alone (no GPU; scripts/sass-lines builds the cubin and runs this).
"""
import collections
import csv
import re
import sys


def sass_lines(path: str, kernel: str):
    """offset -> (file, line), offset -> opcode, for the kernel's .text section of `nvdisasm -gi` output."""
    lines = open(path).read().split("\n")
    heads = [i for i, l in enumerate(lines) if l.startswith("//--------------------- .text") and kernel in l]
    if not heads:
        sys.exit(f"no .text section naming {kernel} in {path}")
    start = heads[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("//---------------------")), len(lines))
    cur, loc, op = None, {}, {}
    for l in lines[start:end]:
        if "//## File" in l:
            chain = [(f.split("/")[-1], int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', l)]
            cu = [c for c in chain if c[0].endswith(".cu")]
            cur = cu[0] if cu else (chain[-1] if chain else None)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", l)
        if m:
            off = int(m.group(1), 16)
            loc[off], op[off] = cur, m.group(2)
    return loc, op


def static_lines(loc, op, kernel: str, top: int) -> int:
    """Static instructions per source line (a loop body's lines count once however often it runs)."""
    count, ops = collections.Counter(), collections.defaultdict(collections.Counter)
    for off, where in loc.items():
        count[where] += 1
        ops[where][op[off].split(".")[0]] += 1
    print(f"{kernel}: {len(loc)} static instructions")
    print("instructions  line  (commonest opcodes)")
    for where, n in count.most_common(top):
        name = f"{where[0]}:{where[1]}" if where else "?"
        print(f"{n:6d}  {name}  " + " ".join(f"{k}:{v}" for k, v in ops[where].most_common(5)))
    return 0


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    loc, op = sass_lines(sys.argv[1], sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    if sys.argv[2] == "-":
        return static_lines(loc, op, sys.argv[3], top)
    rows = list(csv.reader(open(sys.argv[2])))
    hi = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    h = rows[hi]
    col_a, col_s = h.index("Address"), h.index("Source")
    col_smp, col_ex = h.index("Warp Stall Sampling (All Samples)"), h.index("Instructions Executed")
    body = [r for r in rows[hi + 1:] if len(r) > max(col_ex, col_smp) and r[col_a].startswith("0x")]
    base = min(int(r[col_a], 16) for r in body)
    num = lambda x: float(x.replace(",", "") or 0)  # noqa: E731
    agg, tot, mism = collections.defaultdict(lambda: [0.0, 0.0]), [0.0, 0.0], 0
    for r in body:
        off = int(r[col_a], 16) - base
        words = r[col_s].split()
        opc = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        if opc.split(".")[0] != op.get(off, "?").split(".")[0]:
            mism += 1
        e, s = num(r[col_ex]), num(r[col_smp])
        agg[loc.get(off)][0] += e
        agg[loc.get(off)][1] += s
        tot[0] += e
        tot[1] += s
    print(f"{sys.argv[3]}: {len(body)} instructions, {mism} opcode mismatches; {tot[0]:.3g} warp instructions "
          f"executed, {tot[1]:.3g} stall samples")
    print("samples  executed  line")
    for k, (e, s) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{100 * s / (tot[1] or 1):6.1f}%  {100 * e / (tot[0] or 1):6.1f}%   {k[0]}:{k[1]}" if k else
              f"{100 * s / (tot[1] or 1):6.1f}%  {100 * e / (tot[0] or 1):6.1f}%   ?")
    return 0


if __name__ == "__main__":
    sys.exit(main())
