"""Compile one layer's expert GEMMs for Hopper (sm_90a) on a machine without a GPU: registers,
spills, wgmma and TMA use and compile time of every launch and config the autotuner would time,
and, against an earlier run's JSON, the launches whose instructions changed.

    python scripts/compile_report.py --shape qwen3 --out /tmp/compile_new.json
    git stash; python scripts/compile_report.py --shape qwen3 --out /tmp/compile_old.json; git stash pop
    python scripts/compile_report.py --shape qwen3 --compare /tmp/compile_old.json

Run it without TRITON_INTERPRET (the interpreter compiles nothing). The machine's Triton compiles:
install the GPU machine's version (3.6) in a scratch venv to see what the GPU will run.
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
from benchlib.compile_report import compile_layer, diff_histograms, table
from benchlib.shapes import ALIASES, CONFIGS, config_name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", help=f"a layer shape: {', '.join(CONFIGS)} (or {', '.join(ALIASES)})")
    ap.add_argument("--launches", default=None, help="comma list of launches (default: every one)")
    ap.add_argument("--configs", type=int, default=None, help="at most this many configs per launch")
    ap.add_argument("--fresh", action="store_true", help="compile every variant, past Triton's disk cache")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--compare", default=None, help="an earlier run's JSON: print the launches whose instructions changed")
    args = ap.parse_args(argv)
    name = config_name(args.shape)
    if name not in CONFIGS:
        ap.error(f"--shape: unknown {args.shape!r}; expected one of {', '.join(CONFIGS)} or {', '.join(ALIASES)}")
    print(f"compiling {name} {CONFIGS[name]} for sm_90a with Triton {triton.__version__}", flush=True)
    launches = args.launches.split(",") if args.launches else None
    triton.knobs.compilation.always_compile = args.fresh
    records = compile_layer(CONFIGS[name], launches, args.configs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": name, "triton": triton.__version__, "records": records}, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            changed = diff_histograms(json.load(f)["records"], records)
        print("\n".join(changed) if changed else f"every launch compiled to the same instructions as {args.compare}")
    print(table([{k: v for k, v in r.items() if k != "histogram"} for r in records]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
