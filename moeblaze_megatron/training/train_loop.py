"""A minimal Megatron-Core training loop, to train several dispatchers side by side in one process.

Megatron's ``pretrain`` (``scripts/pretrain_gpt.py``) is the way to train; it owns the process
(one model, global state, CUDA only). To compare dispatchers on the same model, seed and data,
``Trainer`` does what one ``pretrain`` iteration does with the same Megatron pieces and nothing
else: Megatron's argument parser and config builders (through ``pretraining``), ``GPTModel``
wrapped in ``Float16Module`` and Megatron's DDP, Megatron's optimizer and LR scheduler, the
no-pipelining schedule, and Megatron's own ``save_checkpoint``/``load_checkpoint`` (the
``--save``/``--load`` code, so its checkpoints are ordinary Megatron checkpoints). It runs on one
GPU, or on the CPU with gloo through ``cpu_shims.enable_cpu_megatron()``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.overrides import TorchFunctionMode

from .attached_graphs import drop_attached_graphs, reset_step_states
from .families import LOCAL_IMPL_ARGS, NO_APEX_ARGS, family_args, have_apex_fusions
from .pretraining import have_transformer_engine

@dataclass
class RunSpec:
    """One training run: model family, dispatcher and the loop's knobs, as Megatron flags."""

    family: str
    dispatcher: str
    seq_length: int
    micro_batch_size: int
    train_iters: int
    data_path: str | None = None  # a Megatron indexed-dataset prefix; None: Megatron's mock data
    num_microbatches: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 5
    seed: int = 1234
    bf16: bool = False
    clip_grad: float = 1.0
    attention: str = "sdpa"
    save: str | None = None
    load: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self):
        family_args(self.family)
        for name in ("seq_length", "micro_batch_size", "train_iters", "num_microbatches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunSpec.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.warmup_iters < self.train_iters:
            raise ValueError(
                f"RunSpec.warmup_iters must be in [0, train_iters={self.train_iters}), got {self.warmup_iters}"
            )

    def megatron_argv(self, device: torch.device) -> list[str]:
        argv = family_args(self.family)
        if not have_transformer_engine():
            argv += LOCAL_IMPL_ARGS
        # Apex, not TE, provides these fused kernels: TE without Apex needs them off too.
        if not have_apex_fusions():
            argv += NO_APEX_ARGS
        argv += [
            "--moe-token-dispatcher-type", self.dispatcher,
            "--moeblaze-attention", self.attention,
            "--seq-length", str(self.seq_length),
            "--max-position-embeddings", str(self.seq_length),
            "--micro-batch-size", str(self.micro_batch_size),
            "--global-batch-size", str(self.micro_batch_size * self.num_microbatches),
            "--train-iters", str(self.train_iters),
            "--lr", str(self.lr), "--min-lr", str(self.min_lr), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(self.warmup_iters), "--weight-decay", "0.1",
            "--clip-grad", str(self.clip_grad), "--seed", str(self.seed),
            "--no-create-attention-mask-in-dataloader", "--split", "98,1,1",
            "--ckpt-format", "torch_dist",
        ]
        argv += ["--data-path", self.data_path] if self.data_path else ["--mock-data"]
        if self.bf16:
            argv.append("--bf16")
        if device.type == "cpu":
            argv.append("--use-cpu-initialization")
        if self.save:
            argv += ["--save", self.save, "--save-interval", str(self.train_iters)]
        if self.load:
            argv += ["--load", self.load]
        return argv + list(self.extra_args)


class CudaFactoriesOnHost(TorchFunctionMode):
    """On a CPU-only run, Megatron's optimizer, schedule and checkpointing allocate small
    bookkeeping tensors with an explicit ``device='cuda'``: create them on the CPU instead.
    (``cpu_shims`` redirects the device queries; these literals need a torch-function mode.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_process(device: torch.device) -> None:
    """torch.distributed (world size 1: nccl on GPU, gloo on CPU) and Megatron's parallel state,
    unless already set up."""
    from megatron.core import parallel_state

    if device.type == "cpu":
        from .cpu_shims import cpu_megatron_enabled

        if not cpu_megatron_enabled():
            raise RuntimeError("a CPU run needs moeblaze_megatron.training.cpu_shims.enable_cpu_megatron() active")
    elif device.index is not None:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo" if device.type == "cpu" else "nccl",
            init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


@contextlib.contextmanager
def single_process(device: torch.device):
    """``init_single_process`` for the duration of the block; undone after it if it created them."""
    from megatron.core import parallel_state

    had_group = torch.distributed.is_initialized()
    had_parallel_state = parallel_state.model_parallel_is_initialized()
    init_single_process(device)
    try:
        yield
    finally:
        if not had_parallel_state:
            parallel_state.destroy_model_parallel()
        if not had_group:
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def quiet_megatron():
    """Megatron prints every argument, every parameter bucket and many deprecation notes; a
    comparison wants its own progress lines only."""
    loggers = [logging.getLogger(name) for name in ("megatron", "torch.distributed")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def parse_megatron_args(argv: list[str]):
    """Megatron's parse + validate (with the plugin's and the entry point's extra arguments), the
    tokenizer built and the global variables set, as ``pretrain`` does before building a model."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from .pretraining import extra_args_provider

    saved_argv = sys.argv
    sys.argv = [saved_argv[0], *argv]
    try:
        with quiet_megatron():
            args = parse_args(extra_args_provider)
            validate_args(args)
            unset_global_variables()
            set_global_variables(args)
    finally:
        sys.argv = saved_argv
    return args


def megatron_dispatchers() -> tuple[str, ...]:
    """The values Megatron's --moe-token-dispatcher-type takes (its TransformerConfig's), and
    the plugin's moeblaze."""
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..megatron_plugin import MOEBLAZE

    stock = typing.get_args(typing.get_type_hints(TransformerConfig)["moe_token_dispatcher_type"])
    return (*stock, MOEBLAZE)


def megatron_argv_problem(argv: list[str]) -> str | None:
    """What Megatron's parser, its validation or the plugin's own check (for the moeblaze
    dispatcher) refuses in ``argv``, as one line; None when a Trainer would accept it. Parsing
    only: nothing is built."""
    from ..megatron_plugin import install

    install()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parse_megatron_args(argv)
    except SystemExit:
        # argparse prints its usage, then "prog: error: message" (the plugin's refusal lists its
        # problems on the lines after it, one "  - " item each).
        text = errors.getvalue()
        message = text.split(": error: ", 1)[1] if ": error: " in text else text
        head, *items = [line.strip() for line in message.strip().splitlines() if line.strip()]
        return " ".join([head, "; ".join(item.removeprefix("- ") for item in items)]).strip()
    except (AssertionError, ValueError) as error:  # Megatron's validate_args refuses by assertion
        return f"{type(error).__name__}: {' '.join(str(error).split())}"
    return None


@dataclass
class StepResult:
    loss: float
    seconds: float
    tokens: int


def _release_device_memory(model_chunks) -> None:
    """Free the parameters, gradient buffers and any graph still attached to the model now,
    whoever still refers to the module objects.

    A graph the model keeps (attached_graphs) makes cycles with the gradient hooks through C++
    autograd nodes that Python's garbage collector does not always break: a closed model stayed
    in device memory (seen on the H200: the third of three models in one process ran out of
    memory)."""
    drop_attached_graphs(model_chunks)
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            param.grad = None
            if hasattr(param, "main_grad"):
                param.main_grad = None
        # Megatron's DDP keeps its contiguous gradient (and parameter) buffers in these lists.
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = vars(chunk).get(name)
            for buffer in buffers if isinstance(buffers, list) else ():
                buffer.grad_data = buffer.param_data = None


class TrainingLoopRecipe:
    """The parts of Megatron's performance recipe that its ``train()`` loop runs, run the same way
    here: TE's per-layer CUDA graphs (``--cuda-graph-impl transformer_engine``) captured once
    ``--cuda-graph-warmup-steps`` steps have run; the whole-iteration graph (``full_iteration``)
    around the schedule; the collector run by hand (``--manual-gc``, every
    ``--manual-gc-interval`` steps). Megatron's schedule itself captures its local graphs."""

    def __init__(self, args, model, config, optimizer):
        self.args, self.start = args, getattr(args, "iteration", 0) or 0
        self.te_graphs = None
        if args.cuda_graph_impl == "transformer_engine":
            from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

            self.te_graphs = TECudaGraphHelper(model=model, config=config, seq_length=args.seq_length,
                                               micro_batch_size=args.micro_batch_size, optimizers=[optimizer])
        if args.manual_gc:
            if args.manual_gc_interval < 0:
                raise ValueError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
            gc.disable()
            gc.collect()

    def schedule(self, forward_backward_func):
        """The schedule, inside the whole-iteration graph where ``full_iteration`` asks for one."""
        if self.args.cuda_graph_impl != "full_iteration":
            return forward_backward_func
        if not hasattr(self, "_full_graph"):
            from megatron.core.full_cuda_graph import FullCudaGraphWrapper

            self._full_graph = FullCudaGraphWrapper(forward_backward_func,
                                                    cuda_graph_warmup_steps=self.args.cuda_graph_warmup_steps)
        return self._full_graph

    def before_step(self, iteration: int) -> None:
        if (self.te_graphs is not None and not self.te_graphs.capture_finished()
                and iteration - self.start == self.args.cuda_graph_warmup_steps):
            self.te_graphs.create_cudagraphs()

    def after_step(self, iteration: int) -> None:
        if self.args.manual_gc and self.args.manual_gc_interval != 0 and iteration % self.args.manual_gc_interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.te_graphs is not None and self.te_graphs.graphs_created():
            self.te_graphs.delete_cuda_graphs()
        if self.args.manual_gc:
            gc.enable()


class Trainer:
    """One model with its optimizer and scheduler, trained step by step.

    ``initial_state``: a model ``state_dict`` to start from instead of the seed's initialization
    (how two dispatchers start from the same weights even if their experts initialize their
    parameters in a different order). ``perturb_ulps``: move every initial weight by this many
    units in the last place of its dtype, in a random direction (a rounding-noise control run).
    """

    def __init__(self, run: RunSpec, device: torch.device, initial_state=None, perturb_ulps: float = 0.0):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
        from megatron.core.utils import get_model_config
        from megatron.training.checkpointing import load_checkpoint
        from megatron.training.models.dist_utils import prepare_existing_model_chunks_for_distributed_training
        from megatron.training.models.gpt import GPTModelBuilder
        from megatron.training.training import (
            get_megatron_ddp_config,
            get_megatron_optimizer_config,
            get_optimizer_param_scheduler,
        )

        from ..megatron_plugin import install
        from .pretraining import build_gpt_datasets, gpt_model_config

        install()
        # Process-global MoE state that Megatron's initialization sets up once per process: the
        # metrics tracker (sized by the first model's layer count) and the aux-loss scale (a [1]
        # tensor on the training device, which the schedule then updates in place).
        destroy_moe_metrics_tracker()
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device=device)
        self.run, self.device = run, device
        init_single_process(device)
        self.args = args = parse_megatron_args(run.megatron_argv(device))
        with self._on_device(), quiet_megatron():
            model_parallel_cuda_manual_seed(args.seed)
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            model_config = gpt_model_config(args)
            model = GPTModelBuilder(model_config).build_model(pg_collection)
            if initial_state is not None:
                model.load_state_dict(initial_state, strict=True)
            if perturb_ulps:
                _perturb_(model, perturb_ulps, seed=args.seed + 1)
            self.model = prepare_existing_model_chunks_for_distributed_training(
                [model], model_config.transformer, pg_collection, ddp_config=get_megatron_ddp_config(args)
            )
            optimizer_config, overrides = get_megatron_optimizer_config(args)
            self.optimizer = get_megatron_optimizer(optimizer_config, self.model, config_overrides=overrides)
            self.scheduler = get_optimizer_param_scheduler(self.optimizer)
            self.config = get_model_config(self.model[0])
            self.config.grad_scale_func = self.optimizer.scale_loss
            self.config.finalize_model_grads_func = finalize_model_grads
            self.iteration = 0
            if args.load:
                self.iteration, _ = load_checkpoint(self.model, self.optimizer, self.scheduler)
            self.tokenizer = build_tokenizer(args)
            samples = args.train_iters * args.global_batch_size
            self.train_dataset = build_gpt_datasets(args, self.tokenizer, [samples, None, None], lambda: True)[0]
            self.recipe = TrainingLoopRecipe(args, self.model, self.config, self.optimizer)

    def unwrapped_state_dict(self) -> dict:
        """The GPTModel's plain state_dict, on the CPU (an ``initial_state`` for another Trainer)."""
        from megatron.core.utils import unwrap_model

        model = unwrap_model(self.model[0])
        return {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in model.state_dict().items()}

    def dataset_batches(self, step: int):
        """The micro-batches of training step ``step``: consecutive samples of the (shuffled)
        training dataset, so a resumed run sees exactly the samples the uninterrupted one did."""
        args = self.args
        first = step * args.global_batch_size
        for m in range(args.global_batch_size // args.micro_batch_size):
            start = first + m * args.micro_batch_size
            samples = [self.train_dataset[i] for i in range(start, start + args.micro_batch_size)]
            yield {key: torch.stack([s[key] for s in samples]).to(self.device)
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}

    def random_batches(self, micro_batch_size: int, seq_length: int, generator: torch.Generator):
        """Micro-batches of random byte tokens of any shape (memory probes need no real text)."""
        for _ in range(self.args.global_batch_size // self.args.micro_batch_size):
            tokens = torch.randint(0, 256, (micro_batch_size, seq_length + 1), generator=generator).to(self.device)
            yield {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro_batch_size, seq_length, device=self.device),
                "position_ids": torch.arange(seq_length, device=self.device).expand(micro_batch_size, -1),
            }

    def train_step(self, batches=None, forward_context=None) -> StepResult:
        """One optimizer step over ``batches`` (default: the dataset's batches of this step).
        ``forward_context``: a context-manager factory entered around each micro-batch's forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from .pretraining import loss_func

        args = self.args
        batches = iter(self.dataset_batches(self.iteration) if batches is None else batches)
        num_microbatches = args.global_batch_size // args.micro_batch_size
        tokens = 0

        def forward_step(data_iterator, model):
            nonlocal tokens
            batch = next(data_iterator)
            tokens += batch["tokens"].numel()
            with forward_context() if forward_context else contextlib.nullcontext():
                output = model(batch["tokens"], batch["position_ids"], None,
                               labels=batch["labels"], loss_mask=batch["loss_mask"])
            return output, partial(loss_func, batch["loss_mask"])

        self._synchronize()
        start = time.perf_counter()
        with self._on_device():
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.recipe.before_step(self.iteration)
            reports = self.recipe.schedule(get_forward_backward_func())(
                forward_step_func=forward_step, data_iterator=batches, model=self.model,
                num_microbatches=num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=False,
            )
            update_ok, _, _ = self.optimizer.step()
            if update_ok:
                self.scheduler.step(increment=args.global_batch_size)
        self._synchronize()
        seconds = time.perf_counter() - start
        self.iteration += 1
        self.recipe.after_step(self.iteration)
        args.iteration = self.iteration
        args.consumed_train_samples += args.global_batch_size
        total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
        # A replayed whole-iteration graph runs no forward_step in Python: count its samples.
        tokens = tokens or num_microbatches * args.micro_batch_size * args.seq_length
        return StepResult(loss=float(total[0] / total[1]), seconds=seconds, tokens=tokens)

    def save(self) -> None:
        """Megatron's save_checkpoint at the current iteration into ``--save``."""
        from megatron.training.checkpointing import save_checkpoint

        if not self.args.save:
            raise ValueError("this run has no save directory (RunSpec.save)")
        with self._on_device(), quiet_megatron():
            save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler, 0)

    def forget_failed_step(self) -> list[str]:
        """After a step that raised (out of memory): drop the graph the model kept of it and the
        gradients it began, and set back the shared experts' overlap state machine, so the next step
        starts where this one did; returns what was dropped and reset (attached_graphs)."""
        dropped = drop_attached_graphs(self.model) + reset_step_states(self.model)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return dropped

    def close(self) -> None:
        """Drop the model and optimizer and Megatron's global variables; free device memory."""
        from megatron.training.global_vars import unset_global_variables

        self.recipe.close()
        # The model's TransformerConfig holds the optimizer's loss-scale hook: drop both.
        self.config.grad_scale_func = self.config.finalize_model_grads_func = None
        _release_device_memory(self.model)
        self.model = self.optimizer = self.scheduler = self.train_dataset = self.config = None
        unset_global_variables()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def _on_device(self):
        """On the CPU: Megatron's literal ``device='cuda'`` allocations go to the host, and
        torch.compile is off (Megatron compiles its fused elementwise ops at import, whatever
        --disable-jit-fuser says; on a CPU each new shape costs seconds of C++ compilation)."""
        if self.device.type != "cpu":
            yield
            return
        with CudaFactoriesOnHost(), torch._dynamo.config.patch(disable=True):
            yield

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@torch.no_grad()
def _perturb_(model: torch.nn.Module, ulps: float, seed: int) -> None:
    generators = {}
    for param in model.parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        sign = torch.randint(0, 2, param.shape, generator=generators[param.device], device=param.device) * 2 - 1
        eps = torch.finfo(param.dtype).eps
        param.copy_((param.float() * (1 + ulps * eps * sign)).to(param.dtype))
