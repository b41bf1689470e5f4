"""Triton compiles in worker processes, side by side, into Triton's disk cache.

Triton's compiler holds the GIL for most of its work (its code generator is Python), so threads
barely compile side by side (benchmarks/notes/compile-latency.md, "Compile workers (processes),
not threads"); worker processes compile in parallel for real. A request is Triton's own serialization of one kernel
specialization (the ``specialization_data`` its ``jit_cache_hook`` receives, which
``JITFunction.preload`` reads back); a worker compiles it for the given target into Triton's disk
cache, where this process's own compile of the same kernel then finds it (a cache hit).

``capture()`` collects the requests of the ``warmup`` calls made inside it, compiling nothing;
``submit`` hands requests to the workers (each one once per process); ``wait_for`` waits for a
kernel's submitted requests before the process compiles that kernel itself. Over described
launches (``calls.KernelCall``): ``compile_requests`` lists one launch's requests,
``prefetch`` hands many launches' compiles over without waiting (``recorded_launches`` lists what
a pass would launch), and the launch path calls ``before_compile`` before it compiles anything
itself and ``compile_ahead`` before the autotuner times a new key's configs. Workers start on
first use (``start``: a Python process each, without torch, fed by a thread here) and exit after
``IDLE_EXIT_S`` without work; ``SETTINGS.compile_workers`` sets how many (0: none, every kernel
compiles in the process as Triton does). A worker that fails costs only its speed-up: the process
compiles what the workers did not, and reports compile errors itself.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from .calls import KernelCall, OneConfig, compiles_in_process, one_config, recording
from .settings import SETTINGS

# A worker's reader thread closes its process after this long without a request.
IDLE_EXIT_S = 120.0
# The longest wait for one kernel's requests; past it the process compiles the kernel itself.
WAIT_LIMIT_S = 600.0
# Past this many distinct requests the record of what was submitted starts afresh.
MAX_REQUESTS = 4096

_lock = threading.Lock()
_requests: dict[tuple, Future] = {}  # (module, name, specialization) -> its compile
_by_kernel: dict[tuple, list[Future]] = {}  # (module, qualname) -> compiles not waited for yet
_stats = {"submitted": 0, "compiled": 0, "failed": 0, "seconds": 0.0}
_idle_tasks: list = []  # run by the next wait on unfinished compiles (``run_while_waiting``)


def enabled() -> bool:
    """Whether compiles go to worker processes: compiled kernels (not the interpreter), at least
    one worker asked for, and none of them found broken."""
    return not SETTINGS.interpret and SETTINGS.compile_workers > 0 and _pool().broken is None


@contextlib.contextmanager
def capture():
    """Inside the block, a ``warmup`` (or launch) of a kernel this process has not compiled yet
    records its compile request in the yielded list instead of compiling (Triton's
    ``jit_cache_hook``); nothing is launched."""
    import triton

    requests = []

    def hook(**kwargs):
        fn = kwargs["fn"]
        requests.append({"module": fn.module, "name": fn.name, "spec": kwargs["compile"]["specialization_data"]})
        return True  # skip the compile

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield requests
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def submit(requests) -> int:
    """Queue ``requests`` (``capture``'s) for the workers, first in first compiled, each distinct
    one once; returns how many were new. Nothing where the workers are off."""
    if not requests or not enabled():
        return 0
    import triton
    from triton.runtime import driver

    target = driver.active.get_current_target()
    common = {"target": [target.backend, target.arch, target.warp_size], "cache_dir": triton.knobs.cache.dir}
    pool, new = _pool(), 0
    with _lock:
        if len(_requests) > MAX_REQUESTS:
            _requests.clear()
        for request in requests:
            key = (request["module"], request["name"], request["spec"])
            if key in _requests:
                continue
            future = Future()
            _requests[key] = future
            _by_kernel.setdefault(key[:2], []).append(future)
            pool.queue.put(({**request, **common}, future))
            new += 1
        _stats["submitted"] += new
    pool.start()
    return new


def wait_for(kernel) -> None:
    """Wait until every submitted request of ``kernel`` (a JIT function or an autotuner over one)
    is compiled or failed, at most ``WAIT_LIMIT_S``."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # an autotuner (or heuristics) over it
        kernel = kernel.fn
    with _lock:
        futures = _by_kernel.pop((kernel.fn.__module__, kernel.fn.__qualname__), None)
    if futures:
        if not all(future.done() for future in futures):
            _run_idle_tasks()
        wait_futures(futures, timeout=WAIT_LIMIT_S)


def run_while_waiting(task) -> None:
    """Have the next wait on compiles that are not done run ``task()`` first (once), so that work
    this process would do anyway soon fills time it would otherwise idle. Nothing with the workers
    off (no wait comes). A task that raises is dropped."""
    if enabled():
        with _lock:
            _idle_tasks.append(task)


def _run_idle_tasks() -> None:
    with _lock:
        tasks = _idle_tasks[:]
        _idle_tasks.clear()
    for task in tasks:
        with contextlib.suppress(Exception):
            task()


def running() -> bool:
    """Whether workers were started (up, or past ``start`` and importing: about a second): where
    none was, a handful of small kernels needed at once compile sooner here than behind a cold
    start."""
    return enabled() and _pool().live > 0


def start() -> None:
    """Start the workers (if on and not running), so they are ready when the first requests come."""
    if enabled():
        _pool().start()


def stats() -> dict:
    """Requests submitted, compiled and failed in the workers so far, and the workers' compile
    seconds (summed over them)."""
    with _lock:
        return dict(_stats)


def before_compile(kernel, *, first: bool) -> None:
    """What the launch path does before this process compiles ``kernel`` (a launch's kernel, or an
    ``OneConfig`` of one) itself: at the process's ``first`` compiled launch start the workers
    (ready for the autotuned launches and layer prefetches to come; not at every miss: under
    expert parallelism new token counts find their kernels in Triton's disk cache), then wait for
    whatever of this kernel the workers are compiling."""
    if first:
        start()
    wait_for(kernel.autotuner if isinstance(kernel, OneConfig) else kernel)


def compile_ahead(call: KernelCall) -> int:
    """Compile in the workers, side by side, every config the autotuner of ``call`` is about to
    time for a new tuning key, and wait for them (the autotuner then finds them in Triton's disk
    cache); returns how many compiles it submitted (0 where the key is tuned already, the workers
    are off, or the configs were submitted before, by ``prefetch``). A config that fails in a
    worker is left to the autotuner, which reports or skips it as it would have."""
    if not enabled():
        return 0
    autotuner, _, args, constexprs = call
    if tuning_key(autotuner, dict(zip(autotuner.arg_names, args)), constexprs) in autotuner.cache:
        return 0
    submitted = submit(compile_requests(call))
    wait_for(autotuner)
    return submitted


def prefetch(calls) -> int:
    """Hand the compiles of ``calls`` (``recorded_launches``') to the workers without waiting:
    every config an autotuned one would time (its tuned config only, where its key is tuned);
    returns how many were submitted (0 with the workers off)."""
    if not enabled():
        return 0
    return submit([request for call in calls for request in compile_requests(call)])


def recorded_launches(device, run) -> list:
    """The ``KernelCall``s that ``run()`` launches, run inside ``calls.recording(device)`` (over
    meta tensors standing for ``device``'s); one that cannot follow meta tensors ends the list
    early (its launches then compile as they come)."""
    with recording(device) as calls, contextlib.suppress(Exception):
        run()
    return calls


def compile_requests(call: KernelCall) -> list:
    """The compile requests (``capture``) of one launch: of each config an autotuned kernel would
    run or time, of the kernel itself otherwise; none for what this process has compiled already."""
    from triton.runtime.autotuner import Autotuner

    kernel, grid, args, constexprs = call
    if compiles_in_process(kernel):
        return []
    kernel, constexprs = one_config(kernel, args, constexprs)
    if isinstance(kernel, OneConfig):
        variants = [(kernel.autotuner.fn, kernel.config, constexprs)]
    elif isinstance(kernel, Autotuner):
        named = dict(zip(kernel.arg_names, args))
        tuned = kernel.cache.get(tuning_key(kernel, named, constexprs))
        if tuned is not None:
            configs = [tuned]
        elif kernel.early_config_prune is not None:
            configs = kernel.early_config_prune(kernel.configs, named, **constexprs)
        else:
            configs = kernel.configs
        variants = [(kernel.fn, config, {**constexprs, **config.all_kwargs()}) for config in configs]
    else:
        variants = [(kernel, None, constexprs)]
    with capture() as requests:
        for fn, config, values in variants:
            if config is not None and config.pre_hook is not None:  # the config's TMA boxes: part of the kernel
                config.pre_hook({**dict(zip(fn.arg_names, args)), **values})
            fn.warmup(*args, grid=grid, **values)
    return requests


def tuning_key(autotuner, named, constexprs) -> tuple:
    """The key Triton's autotuner files a launch's tuned config under (its ``run``): the key
    arguments' values, then every tensor argument's dtype."""
    values = {name: value for name, value in {**named, **constexprs}.items() if name in autotuner.arg_names}
    key = [values[name] for name in autotuner.keys if name in values]
    key += [str(value.dtype) for value in values.values() if hasattr(value, "dtype")]
    return tuple(key)


class _Pool:
    """``size`` worker processes fed from one queue, each by a thread of this process."""

    def __init__(self, size: int):
        self.size = size
        self.queue: queue.Queue = queue.Queue()
        self.live = 0
        self.broken: str | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            while self.live < self.size and self.broken is None:
                self.live += 1
                threading.Thread(target=self._serve, name="moeblaze-compile-worker", daemon=True).start()

    def _serve(self) -> None:
        process = None
        try:
            process = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, _package_root()], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
            if not process.stdout.readline():  # its "ready" line: imports done
                raise RuntimeError(f"a compile worker exited at start with code {process.wait()}")
            while True:
                try:
                    request, future = self.queue.get(timeout=IDLE_EXIT_S)
                except queue.Empty:
                    return
                if not future.set_running_or_notify_cancel():
                    continue
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = process.stdout.readline()
                if not line:
                    future.set_exception(RuntimeError("a compile worker exited"))
                    raise RuntimeError(f"a compile worker exited with code {process.wait()}")
                reply = json.loads(line)
                with _lock:
                    _stats["compiled" if reply["ok"] else "failed"] += 1
                    _stats["seconds"] += reply.get("seconds", 0.0)
                if reply["ok"]:
                    future.set_result(reply["seconds"])
                else:
                    future.set_exception(RuntimeError(reply["error"]))
        except Exception as exc:  # no worker: the process compiles everything itself
            self._break(f"{type(exc).__name__}: {exc}")
        finally:
            with self.lock:
                self.live -= 1
            if process is not None:
                with contextlib.suppress(Exception):
                    process.stdin.close()
                    process.wait(timeout=10)

    def _break(self, reason: str) -> None:
        """Stop using workers: fail every queued request, so nobody waits on it."""
        with self.lock:
            if self.broken is None:
                self.broken = reason
                print(f"moeblaze: compile workers unavailable ({reason}); compiling in this process", file=sys.stderr)
        while True:
            try:
                _, future = self.queue.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(reason))


_the_pool: _Pool | None = None


def _package_root() -> str:
    """The directory holding this package (however this process found it)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# A worker's start: the kernels' modules without the package root's (which imports torch) and
# without torch itself (seconds to import; the kernel modules use it only inside functions), then
# ``serve_stdio``. A compile that did reach for torch fails in the worker, and the requesting
# process compiles that kernel itself.
_BOOTSTRAP = """
import sys, types
root = sys.argv[1]
sys.path.insert(0, root)
package = types.ModuleType("moeblaze_megatron")
package.__path__ = [root + "/moeblaze_megatron"]
sys.modules["moeblaze_megatron"] = package

class NoTorch(types.ModuleType):
    def __getattr__(self, name):
        raise AttributeError(f"torch.{name}: a compile worker runs without torch")

sys.modules["torch"] = NoTorch("torch")
from moeblaze_megatron.kernels.compile_workers import serve_stdio
serve_stdio()
"""


def _pool() -> _Pool:
    global _the_pool
    if _the_pool is None:
        _the_pool = _Pool(SETTINGS.compile_workers)
    return _the_pool


# The worker's side.


def compile_request(request) -> float:
    """Compile one request into Triton's disk cache (``request["cache_dir"]``); returns seconds.

    The specialization is decoded as ``JITFunction.preload`` does it, and compiled with Triton's
    own ``compile`` for the request's target, so that the requesting process's compile of the
    same kernel computes the same cache key."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    if request.get("cache_dir"):
        triton.knobs.cache.dir = request["cache_dir"]
    fn = _resolve(request["module"], request["name"])
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    data = json.loads(request["spec"])

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(_tuples(value["constexpr"]))
        if isinstance(value, dict) and "jit_function" in value:
            return _resolve(*value["jit_function"].split(":"))
        return _tuples(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    target = GPUTarget(*request["target"])
    options = make_backend(target).parse_options(options)
    src = getattr(fn, "ASTSource", triton.compiler.ASTSource)(fn, signature, constexprs, attrs)
    started = time.perf_counter()
    kernel = triton.compile(src, target=target, options=options.__dict__)
    _build_launcher(kernel)
    return time.perf_counter() - started


def _build_launcher(kernel) -> None:
    """Build the kernel's host launcher (a C module, compiled by the system compiler: ~0.3 s on the
    H200 machine) into Triton's cache too, where the requesting process then finds it; nothing
    is loaded on a GPU. Best effort: where it cannot (no CUDA library here, another Triton's
    driver API), the requesting process builds it as it would have."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:
        pass


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _tuples(value):
    """JSON's lists back into the tuples Triton serialized (it takes no lists in a signature)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _serve_requests(requests, replies) -> None:
    """One JSON request per line in, one JSON reply per line out, until the input closes."""
    for line in requests:
        try:
            reply = {"ok": True, "seconds": compile_request(json.loads(line))}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def serve_stdio() -> None:
    """A worker's loop over its standard input and output (see ``_BOOTSTRAP``): the kernel modules
    imported first, then a "ready" line, then one reply per request."""
    # The replies get the original stdout; anything else printed to it goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for name in ("gather_gemm", "weight_grad", "fp8", "combine", "plan_three_step", "plan_sort"):
        with contextlib.suppress(Exception):
            importlib.import_module(f"{__package__}.{name}")
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    _serve_requests(sys.stdin, replies)
