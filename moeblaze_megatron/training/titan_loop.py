"""A minimal torchtitan 0.3.0 training loop, to train stock torchtitan and the MoEBlaze override
side by side in one process (``scripts/compare_torchtitan.py``).

``torchtitan.train`` is the way to train (``titan_example`` is its config module); it owns the
process and its Trainer module imports ``datasets`` (pyarrow, pandas), which the GPU machine does
not carry. ``TitanTrainer`` does what one torchtitan training step does on one device, with
torchtitan's own pieces: the model config and its sharding configs, the override applied by
torchtitan's ``apply_overrides``, meta-device build, ``parallelize_qwen3`` (activation
checkpointing and FSDP2 with bfloat16 mixed precision over a mesh of one, as on one GPU), weight
initialization, AdamW (``default_adamw``) with the MoE load-balancing hook, the warmup-stable-
decay LR schedule, the chunked cross-entropy loss (or the plain one: ``TitanRun.loss``), gradient
clipping, and the CUDA-graph wrapper of the forward-backward step (torchtitan's default on CUDA).
The batches are the built-in corpus packed as torchtitan packs text (``corpus.PackedSamples``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import socket
import tempfile
import time
from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw, register_moe_load_balancing_hook
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.spmd_types import annotate_input_spmd_types
from torchtitan.models.common.attention import FlexAttention

from .attached_graphs import drop_attached_graphs
from .corpus import BYTE_VOCAB_SIZE, PackedSamples, stdlib_source_files
from .titan_choices import ACTIVATION_CHECKPOINTS, COMPILES, LOSSES
from .titan_models import parallelize_qwen3, prepare_model_config, titan_model_config

__all__ = ["ACTIVATION_CHECKPOINTS", "COMPILES", "LOSSES", "OVERRIDE_TARGET", "PHASES", "StepResult", "TitanRun",
           "TitanTrainer", "default_loss", "single_process"]

OVERRIDE_TARGET = "moeblaze_megatron.torchtitan.moeblaze_experts"


def default_loss() -> str:
    """The chunked loss where torch can train it: on torch < 2.12 its ``lm_head.reshard()`` frees
    the final norm's weight (one FSDP unit with lm_head) before backward reaches the norm, and
    backward stops ("... data is not allocated yet"), so there the plain loss."""
    from torch.torch_version import TorchVersion

    return "chunked" if TorchVersion(torch.__version__) >= (2, 12) else "plain"


@dataclass
class TitanRun:
    """One training run. ``override``: the MoEBlaze override's options (None: stock torchtitan)."""

    family: str = "tiny"
    override: dict | None = None
    attention: str = "sdpa"
    local_batch_size: int = 4
    seq_len: int = 64
    steps: int = 20
    lr: float = 3e-3
    warmup_steps: int = 2
    seed: int = 1234
    activation_checkpoint: str = "none"
    cuda_graphs: bool = False
    max_norm: float = 1.0
    loss: str = "chunked"
    compile: str = "off"

    def __post_init__(self):
        if self.activation_checkpoint not in ACTIVATION_CHECKPOINTS:
            raise ValueError(f"activation_checkpoint must be one of {ACTIVATION_CHECKPOINTS}, "
                             f"got {self.activation_checkpoint!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.compile not in COMPILES:
            raise ValueError(f"compile must be one of {COMPILES}, got {self.compile!r}")

    @property
    def compile_config(self) -> CompileConfig:
        """torchtitan's CompileConfig of the run: each block and the loss, or nothing."""
        if self.compile == "off":
            return CompileConfig()
        return CompileConfig(enable=True, components=["model", "loss"], backend=self.compile)

    @property
    def label(self) -> str:
        return "stock" if self.override is None else "moeblaze"


PHASES = ("forward_backward", "clip", "optimizer")


@dataclass
class StepResult:
    loss: float
    seconds: float
    tokens: int
    # Seconds of each of PHASES within the step (CUDA events on a GPU): where a step goes.
    phases: dict = dataclasses.field(default_factory=dict)


class _PhaseClock:
    """Time points between a step's phases: CUDA events on a GPU (no synchronization inside the
    step), the host clock on the CPU (where every op is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def seconds(self) -> dict:
        """After the step's last mark and a synchronization: {phase: seconds}."""
        pairs = zip(self.points, self.points[1:])
        spans = [a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in pairs]
        return dict(zip(PHASES, spans))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process(device: torch.device):
    """A process group of one (NCCL on CUDA, gloo on the CPU) for torchtitan's device meshes,
    unless one exists; on the CPU the meshes are built on the CPU (torchtitan defaults to CUDA)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    # torchtitan puts size-1 mesh axes on torch's "fake" backend, registered by this import.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    parallel_dims_module.device_type = device.type
    own = not dist.is_initialized()
    if own:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


class TitanTrainer:
    """One torchtitan model with its optimizer, LR schedule and loss, trained step by step in a
    process group of one (``single_process``).

    ``initial_state``: a full model state dict (``full_state``) to start from instead of the
    seed's initialization: how stock and MoEBlaze start from the same weights. ``perturb_ulps``:
    move every initial weight by this many units in the last place of bfloat16, the dtype the
    model computes in, in a random direction (the rounding-noise control run).
    """

    def __init__(self, run: TitanRun, device: torch.device, initial_state: dict | None = None,
                 perturb_ulps: float = 0.0):
        self.run, self.device = run, device
        dist_utils.set_spmd_backend("spmd_types")
        self.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                                          spmd_backend="spmd_types")
        self.parallel_dims.build_mesh()
        self.model_config = model_config = titan_model_config(run.family, run.attention)
        prepare_model_config(model_config, seq_len=run.seq_len)
        self.overrides = []
        if run.override is not None:
            # torchtitan's own override machinery, as --override.imports TARGET='{...}' applies it.
            self.overrides = apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, dict(run.override))]),
                                             model_config)
        with torch.device("meta"):
            model = model_config.build()
        ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[run.activation_checkpoint]
        training = TrainingConfig(local_batch_size=run.local_batch_size, seq_len=run.seq_len, steps=run.steps,
                                  max_norm=run.max_norm, disable_cuda_graphs=not run.cuda_graphs)
        with tempfile.TemporaryDirectory() as dump_folder:
            model = parallelize_qwen3(model, parallel_dims=self.parallel_dims, training=training,
                                      parallelism=ParallelismConfig(), compile_config=run.compile_config, ac_config=ac,
                                      dump_folder=dump_folder)
        model.to_empty(device=device)
        torch.manual_seed(run.seed)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        if initial_state is not None:
            load_full_state(model, initial_state)
        if perturb_ulps:
            _perturb_(model, perturb_ulps, seed=run.seed + 1)
        self.model = model
        optimizer = default_adamw(lr=run.lr)
        if device.type != "cuda":
            optimizer = dataclasses.replace(optimizer, implementation="foreach")  # "fused" is CUDA's
        self.optimizers = optimizer.build(model_parts=[model])
        register_moe_load_balancing_hook(self.optimizers, [model], self.parallel_dims)
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=run.warmup_steps, decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1,
        ).build(optimizers=self.optimizers, training_steps=run.steps)
        cross_entropy = CrossEntropyLoss.Config(global_vocab_size=BYTE_VOCAB_SIZE)
        if run.loss == "chunked":
            # As torchtitan's Trainer sets a ChunkedLossWrapper up.
            self.loss_fn = ChunkedLossWrapper.Config(loss_fn=cross_entropy).build(compile_config=run.compile_config)
            self.loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        else:
            self.loss_fn = cross_entropy.build(compile_config=run.compile_config)
        self.context = dist_utils.get_spmd_context(parallel_dims=self.parallel_dims)
        self.flex = isinstance(model_config.first_attention.inner_attention, FlexAttention.Config)
        self.fwd_bwd = self._forward_backward
        if run.cuda_graphs and device.type == "cuda":
            from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

            self.fwd_bwd = wrap_with_cuda_graph(self._forward_backward)
        self.samples = PackedSamples(stdlib_source_files(), run.seq_len)
        self.step = 0

    def full_state(self) -> dict:
        """The model's full (unsharded) state dict on the CPU: an ``initial_state``."""
        return full_state(self.model)

    def next_batch(self):
        """(inputs, labels, positions) [B, L] of the next training step."""
        samples = [self.samples.next_sample() for _ in range(self.run.local_batch_size)]
        return tuple(torch.stack([torch.from_numpy(s[i]) for s in samples]) for i in range(3))

    def random_batch(self, batch_size: int, seq_len: int, generator: torch.Generator):
        """Random byte tokens of any shape (memory probes need no real text)."""
        tokens = torch.randint(0, 256, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.arange(seq_len).expand(batch_size, -1)

    def _forward_backward(self, inputs, labels, global_valid_tokens, extra, forward_context=contextlib.nullcontext):
        # torchtitan's Trainer._forward_backward_body.
        with self.context():
            with forward_context():
                pred = self.model(inputs, **extra)
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, positions=extra["positions"])
                del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss

    def train_step(self, batch=None, *, eager: bool = False, forward_context=None) -> StepResult:
        """One optimizer step on ``batch`` (default: the corpus's next batch). ``eager``: bypass
        the CUDA graph (a batch of another shape); ``forward_context``: a context manager entered
        around the forward and the loss, left before the backward (also eager)."""
        inputs, labels, positions = self.next_batch() if batch is None else batch
        self._synchronize()
        start = time.perf_counter()
        self.optimizers.zero_grad(set_to_none=not self.run.cuda_graphs)
        inputs, labels, positions = (t.to(self.device) for t in (inputs, labels, positions))
        global_valid_tokens = (labels != IGNORE_INDEX).sum()
        extra = {"positions": positions}
        if self.flex:
            extra["attention_masks"] = self.model.get_attention_masks(positions=positions)
        inputs, labels, extra = annotate_input_spmd_types(self.parallel_dims, inputs, labels, extra)
        clock = _PhaseClock(self.device)
        clock.mark()
        if forward_context is not None:
            loss = self._forward_backward(inputs, labels, global_valid_tokens, extra, forward_context)
        elif eager:
            loss = self._forward_backward(inputs, labels, global_valid_tokens, extra)
        else:
            loss = self.fwd_bwd(inputs, labels, global_valid_tokens, extra)
        clock.mark()
        loss = float(loss.detach())  # before the next replay overwrites a graph's output
        dist_utils.clip_grad_norm_([p for p in self.model.parameters()], self.run.max_norm, foreach=True)
        clock.mark()
        self.optimizers.step()
        self.lr_schedulers.step()
        clock.mark()
        self._synchronize()
        self.step += 1
        return StepResult(loss=loss, seconds=time.perf_counter() - start, tokens=int(labels.numel()),
                          phases=clock.seconds())

    def routed_experts(self) -> list[torch.nn.Module]:
        return [layer.moe.routed_experts for layer in self.model.layers.values()]

    def forget_failed_step(self) -> list[str]:
        """After a step that raised (out of memory): drop the graph the model kept of it and the
        gradients it began; returns what was dropped (attached_graphs)."""
        from torch.distributed.fsdp import FSDPModule

        dropped = drop_attached_graphs([self.model])
        # A backward that raised leaves FSDP2's units mid-backward (training state, the queued
        # final callback, parameters unsharded): the next step's backward then finds parameters
        # freed. FSDP2 has no public reset; these are its own fields (torch 2.6 to 2.14).
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                state._state_ctx.post_backward_final_callback_queued = False
                state._training_state = TrainingState.IDLE
                group = state._fsdp_param_group
                if group is not None:
                    group._training_state = TrainingState.IDLE
                module.reshard()
        self.optimizers.zero_grad(set_to_none=not self.run.cuda_graphs)
        return dropped

    def release_cuda_graph(self) -> None:
        """Free the captured step (its memory pool); later steps run eagerly."""
        if self.run.cuda_graphs and self.device.type == "cuda":
            # torchtitan's teardown, not the wrappers' alone: its manager's warm-up graph keeps the
            # shared pool, and every block the captured step took, reserved. The next wrapper sets
            # the manager up again.
            from torchtitan.distributed import cudagraph

            cudagraph.cudagraph_teardown()
            self.fwd_bwd = self._forward_backward

    def close(self) -> None:
        """Drop the model, its optimizer and any CUDA graph; free device memory."""
        self.release_cuda_graph()
        self.model = self.optimizers = self.lr_schedulers = self.loss_fn = self.fwd_bwd = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def full_state(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` (torchtitan's keys: its state-dict hooks run) as whole tensors on
    the CPU."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
            for k, v in model.state_dict().items()}


def load_full_state(model: torch.nn.Module, state: dict) -> None:
    """Load whole tensors (``full_state``'s) into a parallelized model, each distributed as the
    model's own entry is."""
    current = model.state_dict()
    sharded = {}
    for key, value in state.items():
        target = current.get(key)
        if isinstance(target, DTensor):
            value = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements)
        elif isinstance(target, torch.Tensor):
            value = value.to(target.device, target.dtype)
        sharded[key] = value
    model.load_state_dict(sharded, strict=True)


@torch.no_grad()
def _perturb_(model: torch.nn.Module, ulps: float, seed: int) -> None:
    """Every parameter times (1 +- ulps * eps(bfloat16)), the sign drawn per element."""
    eps = torch.finfo(torch.bfloat16).eps
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        sign = torch.randint(0, 2, local.shape, generator=generator).to(local.device) * 2 - 1
        local.mul_(1 + ulps * eps * sign.to(local.dtype))
