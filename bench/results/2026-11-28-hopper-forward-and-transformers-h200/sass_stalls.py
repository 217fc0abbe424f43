"""Where the Hopper forward's warps stall, from ncu's SASS-level source page
(ncu --import X.ncu-rep --page source --csv --print-source sass > X.csv).

Prints the stall reasons over all samples and the samples by how often an instruction ran: once
per key tile per consumer warp (the main loop), once per unit (a query tile of one head: its
first tile, mask, epilogue), or otherwise (the producer).

  python3 sass_stalls.py before/fwd_sass.csv [after/fwd_sass.csv ...]
"""
import csv
import sys


def summary(path: str) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    samples, executed = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[samples] or 0) for r in data)
    by_reason = {h: sum(int(r[col[h]] or 0) for r in data) for h in reasons}
    counts: dict[int, int] = {}
    for r in data:
        counts[int(r[executed] or 0)] = counts.get(int(r[executed] or 0), 0) + int(r[samples] or 0)
    per_tile = max(counts, key=lambda e: counts[e] if e > 0 else -1)  # the main loop's count
    tile = sum(s for e, s in counts.items() if e >= 0.9 * per_tile)
    print(f"{path}: {total} samples")
    for h, v in sorted(by_reason.items(), key=lambda x: -x[1])[:8]:
        print(f"  {h:24s} {v:7d} {v / total:6.1%}")
    print(f"  per-tile instructions (run ~{per_tile:,} times): {tile / total:.1%} of samples")
    for r in sorted(data, key=lambda r: -int(r[samples] or 0))[:8]:
        print(f"  {int(r[samples]):6d} x{int(r[executed] or 0):>8,}  {r[1].strip()[:64]}")


for p in sys.argv[1:]:
    summary(p)
