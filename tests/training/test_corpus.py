"""The built-in corpus: byte tokens in a Megatron indexed dataset, read back by Megatron's own
IndexedDataset and GPTDataset with the NullTokenizer that the training flags name."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from moeblaze_megatron.training.corpus import (
    BYTE_VOCAB_SIZE,
    EOD_ID,
    TOKENIZER_ARGS,
    build_byte_dataset,
    dataset_exists,
    encode_bytes,
    stdlib_source_files,
)

REPO = Path(__file__).resolve().parents[2]

# Awkward documents: empty, non-UTF-8 bytes, every byte value, a long one.
DOCUMENTS = {
    "a.py": b"print('hello')\n",
    "empty.py": b"",
    "latin1.py": "# caf\xe9\n".encode("latin-1"),
    "pkg/all_bytes.py": bytes(range(256)),
    "pkg/long.py": b"x = 1\n" * 500,
}


@pytest.fixture
def source_tree(tmp_path):
    root = tmp_path / "src"
    for name, data in DOCUMENTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_bytes(b"not the stdlib\n")
    (root / "notes.txt").write_bytes(b"not python\n")
    return root


def megatron_tokenizer():
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-type")
    parser.add_argument("--vocab-size", type=int)
    args = parser.parse_args(list(TOKENIZER_ARGS))
    args.null_tokenizer_eod_id = None
    args.null_tokenizer_pad_id = -1
    args.pad_vocab_size = False
    return build_tokenizer(args)


def test_tokenizer_flags_give_byte_vocabulary_and_eod():
    tokenizer = megatron_tokenizer()
    assert tokenizer.vocab_size == BYTE_VOCAB_SIZE == 257
    assert tokenizer.eod == EOD_ID == 256


def test_encode_bytes_is_bytes_then_eod():
    tokens = encode_bytes(bytes([0, 255, 10]))
    assert tokens.dtype == numpy.uint16
    assert tokens.tolist() == [0, 255, 10, EOD_ID]
    assert encode_bytes(b"").tolist() == [EOD_ID]


def test_source_files_are_python_only_and_deterministic(source_tree):
    files = stdlib_source_files(source_tree)
    names = sorted(p.relative_to(source_tree).as_posix() for p in files)
    assert names == sorted(DOCUMENTS)
    assert files == stdlib_source_files(source_tree)
    with pytest.raises(FileNotFoundError, match="directory"):
        stdlib_source_files(source_tree / "missing")


def test_default_corpus_is_this_pythons_stdlib():
    files = stdlib_source_files()
    assert len(files) > 500
    assert any(p.name == "argparse.py" for p in files)
    assert not any("site-packages" in p.parts for p in files)


def test_indexed_dataset_round_trip(source_tree, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    files = stdlib_source_files(source_tree)
    stats = build_byte_dataset(tmp_path / "out" / "corpus", files)
    assert dataset_exists(tmp_path / "out" / "corpus")
    assert stats["num_documents"] == len(DOCUMENTS)
    assert stats["num_tokens"] == sum(len(d) + 1 for d in DOCUMENTS.values())
    assert json.loads((tmp_path / "out" / "corpus.json").read_text()) == stats

    dataset = IndexedDataset(str(tmp_path / "out" / "corpus"))
    assert len(dataset) == len(files)
    for i, path in enumerate(files):
        tokens = dataset[i]
        assert tokens[-1] == EOD_ID
        assert bytes(tokens[:-1].astype(numpy.uint8)) == path.read_bytes()
        assert int(tokens.max()) <= EOD_ID


def test_max_bytes_stops_at_whole_files(source_tree, tmp_path):
    files = stdlib_source_files(source_tree)
    stats = build_byte_dataset(tmp_path / "small", files, max_bytes=1)
    # The first non-empty file reaches the limit; the empty ones before it are kept.
    sizes = [len(p.read_bytes()) for p in files]
    first_nonempty = next(i for i, s in enumerate(sizes) if s > 0)
    assert stats["num_documents"] == first_nonempty + 1
    with pytest.raises(ValueError, match="max_bytes"):
        build_byte_dataset(tmp_path / "bad", files, max_bytes=0)


def test_gpt_dataset_reads_it_with_eod_handling(source_tree, tmp_path):
    """Megatron's GPTDataset over the corpus: samples are shifted byte sequences that cross
    documents at EOD, and --eod-mask-loss masks exactly the EOD targets' positions."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    build_byte_dataset(tmp_path / "corpus", stdlib_source_files(source_tree))
    seq = 64
    for eod_mask_loss in (False, True):
        config = GPTDatasetConfig(
            random_seed=1, sequence_length=seq, blend=([str(tmp_path / "corpus")], None), split="100,0,0",
            tokenizer=megatron_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
            eod_mask_loss=eod_mask_loss, create_attention_mask=False, path_to_cache=str(tmp_path / "cache"),
        )
        train = BlendedMegatronDatasetBuilder(GPTDataset, [8, 0, 0], lambda: True, config).build()[0]
        saw_eod = False
        for i in range(len(train)):
            sample = train[i]
            tokens, labels, loss_mask = sample["tokens"], sample["labels"], sample["loss_mask"]
            assert tokens.shape == labels.shape == loss_mask.shape == (seq,)
            assert torch.equal(tokens[1:], labels[:-1])
            assert int(tokens.max()) <= EOD_ID
            eod = tokens == EOD_ID
            saw_eod |= bool(eod.any())
            expected_mask = (~eod).float() if eod_mask_loss else torch.ones(seq)
            assert torch.equal(loss_mask, expected_mask)
        assert saw_eod


def test_prepare_data_cli(tmp_path, source_tree):
    prefix = tmp_path / "cli" / "corpus_text_document"
    command = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--output-prefix", str(prefix),
               "--source-dir", str(source_tree)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "--data-path " + str(prefix) in first.stdout
    assert "--tokenizer-type NullTokenizer --vocab-size 257" in first.stdout
    assert dataset_exists(prefix)
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already built" in again.stdout
    bad = subprocess.run(command + ["--max-mb", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--max-mb must be positive" in bad.stderr
