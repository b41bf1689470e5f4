"""The op at two checkouts of the package, side by side on one GPU: bitwise equality of the
output and every gradient, and the forward+backward time of each, alternating revisions over
rounds in fresh processes (so neither gets a warmer cache).

    python scripts/compare_revisions.py --old /path/to/old/checkout --new . --configs 7b,qwen3 --out ab.json

A checkout is a directory holding ``moeblaze_megatron/``. Each round runs every config at each
revision in its own process; the table reports whether every digest matched and each revision's
median time over the rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import torch
from benchlib.shapes import CONFIGS, known_config_names, make_inputs
from benchlib.timing import cuda_time


def _digest(t) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(-1).view(dtype=torch.uint8).numpy().tobytes()).hexdigest()[:16]


def worker(root: str, configs: list[str], recompute: str, reps: int) -> dict:
    """In this process (started with ``root`` first on PYTHONPATH): the package of ``root``, every
    config's digests and median step ms."""
    import moeblaze_megatron
    from moeblaze_megatron import moe_mlp

    assert os.path.dirname(os.path.dirname(os.path.abspath(moeblaze_megatron.__file__))) == os.path.abspath(root)
    results = {}
    for name in configs:
        T, d, h, E, K = CONFIGS[name]
        x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, "cuda", seed=1)
        x, probs, fc1, fc2 = (t.requires_grad_() for t in (x, probs, fc1, fc2))
        generator = torch.Generator("cuda").manual_seed(2)
        upstream = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=generator)

        def step():
            for t in (x, probs, fc1, fc2):
                t.grad = None
            out = moe_mlp(x, ids, probs, fc1, fc2, "swiglu", recompute=recompute, backend="triton", validate=False)
            out.backward(upstream)
            return out

        for _ in range(3):
            step()
        out = step()
        digests = {"out": _digest(out), **{k: _digest(t.grad) for k, t in zip(("dx", "dprobs", "dfc1", "dfc2"),
                                                                               (x, probs, fc1, fc2))}}
        results[name] = dict(digests=digests, ms=cuda_time(step, 2, reps)[0])
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="checkout directory of the old revision")
    parser.add_argument("--new", required=True, help="checkout directory of the new revision")
    parser.add_argument("--configs", default="7b,qwen3", help="comma list of benchlib.shapes configs")
    parser.add_argument("--recompute", default="activation", choices=("activation", "fc1"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="timed steps per config and process")
    parser.add_argument("--out", help="JSON report")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configs = known_config_names(args.configs, "compare_revisions.py")
    for label in ("old", "new"):
        if not os.path.isdir(os.path.join(getattr(args, label), "moeblaze_megatron")):
            parser.error(f"--{label} {getattr(args, label)!r} holds no moeblaze_megatron/ package")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the op's Triton kernels are timed there)")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, configs, args.recompute, args.reps)))
        return
    runs = {"old": [], "new": []}
    for round_index in range(args.rounds):
        for label in (("old", "new") if round_index % 2 == 0 else ("new", "old")):
            command = [sys.executable, os.path.abspath(__file__), "--old", args.old, "--new", args.new,
                       "--configs", ",".join(configs), "--recompute", args.recompute, "--reps", str(args.reps),
                       "--worker", getattr(args, label)]
            root = getattr(args, label)
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"compare_revisions.py: the {label} revision failed:\n{done.stderr[-4000:]}")
            runs[label].append(json.loads(lines[-1][len("RESULT "):]))
            print(f"round {round_index + 1}/{args.rounds}: {label} done", flush=True)
    report = {}
    for name in configs:
        digests = {label: [run[name]["digests"] for run in runs[label]] for label in runs}
        same = all(d == digests["old"][0] for label in runs for d in digests[label])
        times = {label: sorted(run[name]["ms"] for run in runs[label])[len(runs[label]) // 2] for label in runs}
        report[name] = dict(bitwise_equal=same, old_ms=times["old"], new_ms=times["new"], digests=digests)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(recompute=args.recompute, rounds=args.rounds, reps=args.reps, configs=report), f, indent=1)
    print("\n| config | bitwise equal | old ms | new ms | new / old |\n|---|---|---|---|---|")
    for name, row in report.items():
        print(f"| {name} | {row['bitwise_equal']} | {row['old_ms']:.2f} | {row['new_ms']:.2f} | "
              f"{row['new_ms'] / row['old_ms']:.3f} |")


if __name__ == "__main__":
    main()
