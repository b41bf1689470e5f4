"""A config module for ``torchtitan.train``: a Qwen3-MoE-like model on one GPU, trained on the
built-in corpus (the Python standard library's source) with a byte tokenizer; nothing to download.

    torchrun --standalone --nproc-per-node 1 -m torchtitan.train \\
        --module moeblaze_megatron.training.titan_example --config qwen3_moe \\
        --override.imports moeblaze_megatron.torchtitan.moeblaze_experts

Without ``--override.imports`` the same command trains stock torchtitan (same model, seed and
data). ``--config tiny`` is the small model the tests parse (torchtitan's Trainer itself wants a
GPU). Every torchtitan flag applies (``--training.steps``, ``--training.seq_len``,
``--checkpoint.enable``, ...).

The tokenizer and the dataloader are torchtitan components (``BaseTokenizer``,
``ParallelAwareDataloader``) over ``training.corpus``: bytes 0-255 and an end-of-document token
256, documents packed as torchtitan's text datasets pack them (``corpus.PackedSamples``).
This module imports torchtitan's Trainer (and with it ``datasets``); the GPU comparison does not
use it (``training.titan_loop``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.trainer import Trainer

from .corpus import BYTE_VOCAB_SIZE, EOD_ID, PackedSamples, stdlib_source_files
from .titan_models import titan_model_spec

__all__ = ["BuiltinCorpusDataLoader", "ByteTokenizer", "qwen3_moe", "tiny"]


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as ids 0-255 and one end-of-document id 256 (Megatron's NullTokenizer with
    vocabulary 257, what the Megatron comparison trains on). No files."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        del config, tokenizer_path  # nothing to load
        super().__init__()
        self.eos_id = EOD_ID
        self.bos_id = None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, **kwargs) -> list[int]:
        del add_bos  # no beginning-of-document token
        ids = list(text.encode("utf-8"))
        return ids + [EOD_ID] if add_eos else ids

    def decode(self, ids, **kwargs) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE


class _CorpusDataset(IterableDataset, Stateful):
    def __init__(self, seq_len: int, dp_rank: int, dp_world_size: int):
        self.samples = PackedSamples(stdlib_source_files(), seq_len, dp_rank, dp_world_size)

    def __iter__(self):
        while True:
            inputs, labels, positions = (torch.from_numpy(a) for a in self.samples.next_sample())
            yield {"input": inputs, "positions": positions}, labels

    def state_dict(self):
        return self.samples.state_dict()

    def load_state_dict(self, state_dict):
        self.samples.load_state_dict(state_dict)


class BuiltinCorpusDataLoader(ParallelAwareDataloader):
    """The built-in corpus as torchtitan batches ({"input", "positions"}, labels), endless."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "pystdlib"

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        del tokenizer, kwargs  # the corpus is tokenized as bytes
        super().__init__(_CorpusDataset(seq_len, dp_rank, dp_world_size), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, batch_size=local_batch_size, num_workers=config.num_workers,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def _trainer_config(family: str, *, attention: str, local_batch_size: int, seq_len: int, steps: int,
                    lr: float) -> Trainer.Config:
    model_spec = titan_model_spec(family, attention)
    return Trainer.Config(
        model_spec=model_spec,
        # No Hugging Face assets: the byte tokenizer reads no files.
        hf_assets_path=".",
        dump_folder="runs/titan",
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=BYTE_VOCAB_SIZE)),
        tokenizer=ByteTokenizer.Config(),
        dataloader=BuiltinCorpusDataLoader.Config(),
        metrics=MetricsProcessor.Config(log_freq=10),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=max(1, steps // 10), decay_ratio=0.8,
                                                  decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps),
        checkpoint=CheckpointManager.Config(interval=steps, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def qwen3_moe() -> Trainer.Config:
    """Qwen3-30B-A3B's MoE layers in 4 layers (``titan_models.TITAN_FAMILIES``) on one GPU:
    2 x 4096 tokens a step, 200 steps, torchtitan's flex attention."""
    return _trainer_config("qwen3_moe", attention="flex", local_batch_size=2, seq_len=4096, steps=200, lr=3e-4)


def tiny() -> Trainer.Config:
    """The CPU-sized model (2 layers, width 64, 8 experts, top-2), 4 x 64 tokens a step."""
    return _trainer_config("tiny", attention="sdpa", local_batch_size=4, seq_len=64, steps=20, lr=3e-3)
