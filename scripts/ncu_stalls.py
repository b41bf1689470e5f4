"""Where a profiled kernel's warps wait: Nsight Compute's per-instruction stall samples (the
gpu_suite ncu step's ncu_source.csv, or its .gz) grouped by loop level, and the costliest
instructions.

    python scripts/ncu_stalls.py benchmarks/results/2026-12-06-h100-v31/call8_ncu_source.csv.gz
"""

from __future__ import annotations

import argparse
import sys

from benchlib.ncu_source import report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=25, help="instructions listed (default 25)")
    ap.add_argument("--loops", type=int, default=8, help="loop levels listed (default 8)")
    args = ap.parse_args(argv)
    try:
        print(report(args.source, args.top, args.loops))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
