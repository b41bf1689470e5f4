#!/usr/bin/env python3
"""Build the built-in pretraining corpus: the Python standard library as a Megatron indexed dataset.

    python scripts/prepare_data.py                      # -> data/pystdlib_text_document.{bin,idx,json}
    python scripts/prepare_data.py --max-mb 4 --output-prefix /tmp/small_text_document

Train on it with Megatron's usual flags:
    --data-path data/pystdlib_text_document --tokenizer-type NullTokenizer --vocab-size 257
(byte-level tokens 0-255, end of document 256: no tokenizer download).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from moeblaze_megatron.training.corpus import build_byte_dataset, dataset_exists, stdlib_source_files

# Importing Megatron-Core warns about every optional accelerator library it does not find.
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

DEFAULT_PREFIX = "data/pystdlib_text_document"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-prefix", default=DEFAULT_PREFIX, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--source-dir", default=None, help="a directory of .py files (default: this Python's stdlib)")
    parser.add_argument("--max-mb", type=float, default=None, help="stop after about this many MB of source")
    parser.add_argument("--force", action="store_true", help="rebuild even if the dataset exists")
    args = parser.parse_args(argv)
    if args.max_mb is not None and args.max_mb <= 0:
        parser.error(f"--max-mb must be positive, got {args.max_mb}")

    if dataset_exists(args.output_prefix) and not args.force:
        print(f"{args.output_prefix}: already built (use --force to rebuild)")
        return 0
    start = time.perf_counter()
    files = stdlib_source_files(args.source_dir)
    max_bytes = None if args.max_mb is None else int(args.max_mb * 1e6)
    print(f"tokenizing {len(files)} files from {args.source_dir or 'the standard library'} ...", flush=True)
    stats = build_byte_dataset(args.output_prefix, files, max_bytes=max_bytes)
    print(
        f"{stats['prefix']}: {stats['num_documents']} documents, {stats['num_tokens']:,} tokens "
        f"in {time.perf_counter() - start:.1f}s (sha256 {stats['sha256'][:16]})"
    )
    print("train with: --data-path " + stats["prefix"] + " " + " ".join(stats["tokenizer_args"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
