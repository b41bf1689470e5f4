#!/usr/bin/env python3
"""The short table of the Transformer Engine steps of scripts/gpu_suite.sh, from the JSON records
in a results folder (gpu_megatron_check_te.json, bench_layer_te.json, te_select_<family>.json,
te_compare_<family>.json), printed and written beside them as te_summary.md.

    python scripts/te_summary.py benchmarks/results/latest
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchlib.te_report import summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="the results folder (gpu_suite.sh's $OUT)")
    args = parser.parse_args(argv)
    folder = Path(args.results)
    if not folder.is_dir():
        parser.error(f"results: {folder} is not a folder")
    text = summary(folder)
    if not text:
        print(f"te_summary: no TE records in {folder}")
        return 1
    (folder / "te_summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
