"""A real pretraining corpus that needs no download: the Python standard library's source.

Every machine with Python has it. Tokens are UTF-8 bytes (ids 0-255) and one end-of-document
token (id 256), which is exactly Megatron's ``NullTokenizer`` with ``--vocab-size 257`` (its EOD
is ``vocab_size - 1``): Megatron's dataset builder, the GPT dataset's EOD handling and the vocab
padding all work unchanged, and no tokenizer file is needed. ``build_byte_dataset`` writes a
Megatron indexed dataset (.bin/.idx) that ``--data-path`` reads like any other.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy

EOD_ID = 256
BYTE_VOCAB_SIZE = 257
# The Megatron flags that describe this tokenization.
TOKENIZER_ARGS = ("--tokenizer-type", "NullTokenizer", "--vocab-size", str(BYTE_VOCAB_SIZE))
# Documents are shuffled with a fixed seed so that --split's validation and test ranges sample
# the whole library rather than the last modules in alphabetical order.
_DOCUMENT_ORDER_SEED = 0


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library (third-party packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise FileNotFoundError(f"root must be a directory of Python sources, got {str(root)!r}")
    files = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and not {"site-packages", "dist-packages"} & set(p.parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(f"no .py files under {str(root)!r}")
    order = numpy.random.default_rng(_DOCUMENT_ORDER_SEED).permutation(len(files))
    return [files[i] for i in order]


def encode_bytes(data: bytes) -> numpy.ndarray:
    """One document as token ids: its bytes, then the end-of-document token."""
    tokens = numpy.empty(len(data) + 1, dtype=numpy.uint16)
    tokens[:-1] = numpy.frombuffer(data, dtype=numpy.uint8)
    tokens[-1] = EOD_ID
    return tokens


def build_byte_dataset(output_prefix: str | Path, files: list[Path], max_bytes: int | None = None) -> dict:
    """Write ``<output_prefix>.bin/.idx`` (one document per file) and ``<output_prefix>.json``.

    ``max_bytes`` stops after the first files whose sizes reach it (whole files only). Returns
    the statistics also written to the JSON file, including a SHA-256 of the token stream so
    that two machines can tell whether they trained on the same corpus.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{output_prefix}.bin", dtype=numpy.uint16)
    digest = hashlib.sha256()
    num_documents = num_tokens = 0
    for path in files:
        tokens = encode_bytes(path.read_bytes())
        builder.add_document(tokens, [tokens.size])
        digest.update(tokens.tobytes())
        num_documents += 1
        num_tokens += tokens.size
        if max_bytes is not None and num_tokens - num_documents >= max_bytes:
            break
    builder.finalize(f"{output_prefix}.idx")
    stats = {
        "prefix": str(output_prefix),
        "num_documents": num_documents,
        "num_tokens": num_tokens,
        "sha256": digest.hexdigest(),
        "tokenizer_args": list(TOKENIZER_ARGS),
    }
    Path(f"{output_prefix}.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def dataset_exists(output_prefix: str | Path) -> bool:
    """Whether a complete dataset (.bin, .idx and the stats JSON written last) is at the prefix."""
    return all(Path(f"{output_prefix}{ext}").is_file() for ext in (".bin", ".idx", ".json"))
