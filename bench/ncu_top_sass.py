#!/usr/bin/env python3
"""Top SASS instructions (or CUDA lines, with --print-source cuda) by stall samples from
`ncu -i REP --page source --csv --print-source sass`
(stdin): prints the N hottest with their share of the kernel's samples. Used on the GPU host to read
a kernel's hot spots without carrying the whole report back.

    ncu -i rep.ncu-rep --page source --csv --print-source sass | python3 bench/ncu_top_sass.py [N]
"""
import csv
import sys


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rows = list(csv.reader(sys.stdin))
    hdr_i = next(i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r))
    hdr = rows[hdr_i]
    src = hdr.index("Source")
    smp = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
    # SASS view: the instruction address; CUDA source view (-lineinfo builds): the line number
    addr = next((hdr.index(c) for c in ("Address", "#", "Line") if c in hdr), None)
    body = [r for r in rows[hdr_i + 1:] if len(r) > smp]
    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[smp]) for r in body) or 1.0
    for r in sorted(body, key=lambda r: -num(r[smp]))[:n]:
        print(f"{100 * num(r[smp]) / total:5.1f}%  {r[addr] if addr is not None else ''}  {r[src]}")


if __name__ == "__main__":
    sys.exit(main())
