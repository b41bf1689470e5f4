"""Run a Megatron-LM entry point with MoEBlaze installed:

    torchrun --nproc-per-node 8 -m moeblaze_megatron.training.run /path/to/Megatron-LM/pretrain_gpt.py \\
        <the entry point's own flags> --moe-token-dispatcher-type moeblaze [--moeblaze-* flags]

``install()`` runs first, then the script runs as ``__main__`` with its own directory first on
``sys.path`` (as ``python script.py`` would have it), so its imports (``gpt_builders``,
``model_provider``) resolve and every ``--moeblaze-*`` flag reaches every MoE layer through the
script's own argument parse, config builder and spec builders. The same as adding
``import moeblaze_megatron; moeblaze_megatron.install()`` at the top of the script.
"""

from __future__ import annotations

import os
import runpy
import sys

from ..megatron_plugin import install

USAGE = ("usage: python -m moeblaze_megatron.training.run SCRIPT.py [SCRIPT'S ARGUMENTS ...]\n"
         "  (under torchrun: torchrun [torchrun options] -m moeblaze_megatron.training.run SCRIPT.py ...)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip().splitlines()[0])
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"moeblaze_megatron.training.run: error: SCRIPT {script!r} is not a file (give the path to "
                         "Megatron-LM's pretrain_gpt.py or another entry point)")
    install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
