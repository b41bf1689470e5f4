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


class PackedSamples:
    """Fixed-length training samples from the corpus, packed as torchtitan's text datasets pack
    them: every document (its bytes, then EOD) is split into inputs ``tokens[:-1]`` and labels
    ``tokens[1:]`` (a document's last token never predicts the next one's first), positions
    restart at 0 with each document (torchtitan's block-causal masks and RoPE read them), and
    the streams are cut into samples of ``seq_len``. Rank ``dp_rank`` of ``dp_world_size`` reads
    documents ``dp_rank, dp_rank + dp_world_size, ...``; after the last document it starts over.
    Deterministic; ``state_dict`` / ``load_state_dict`` resume mid-stream (checkpoints).
    """

    def __init__(self, files: list[Path], seq_len: int, dp_rank: int = 0, dp_world_size: int = 1):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        self.files = files[dp_rank::dp_world_size]
        if not self.files:
            raise ValueError(f"no documents for data-parallel rank {dp_rank} of {dp_world_size}")
        self.seq_len = seq_len
        self.next_document = 0
        self.buffers = [numpy.empty(0, dtype=numpy.int64) for _ in range(3)]

    def _read_document(self) -> None:
        tokens = encode_bytes(self.files[self.next_document % len(self.files)].read_bytes()).astype(numpy.int64)
        self.next_document += 1
        pieces = (tokens[:-1], tokens[1:], numpy.arange(tokens.size - 1, dtype=numpy.int64))
        self.buffers = [numpy.concatenate([b, p]) for b, p in zip(self.buffers, pieces)]

    def next_sample(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """(inputs, labels, positions), each ``seq_len`` int64 tokens."""
        while self.buffers[0].size < self.seq_len:
            self._read_document()
        sample = [b[: self.seq_len] for b in self.buffers]
        self.buffers = [b[self.seq_len :] for b in self.buffers]
        positions = sample[2]
        # A document continued from the previous sample starts at position 0 here too.
        first = positions[0]
        if first > 0:
            restart = numpy.flatnonzero(positions == 0)
            end = restart[0] if restart.size else positions.size
            positions = positions.copy()
            positions[:end] -= first
        return sample[0], sample[1], positions

    def state_dict(self) -> dict:
        return {"next_document": self.next_document, "buffers": [b.tolist() for b in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        self.next_document = state["next_document"]
        self.buffers = [numpy.asarray(b, dtype=numpy.int64) for b in state["buffers"]]
