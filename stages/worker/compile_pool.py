"""Parallel Triton compiles for the warm-up. The worker records what its launches would compile (Triton's
`jit_cache_hook`, which then skips the compile and the launch), a pool of processes compiles those exact
specializations for an explicit target into the shared on-disk cache (no GPU is needed there), and the
worker's own launches then only load them. The cache directory is namespaced by target, Triton version
and a hash of our kernel sources, so that a cache made for another GPU or other kernels is never read.
"""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
# The modules whose @triton.jit kernels the warm-up compiles: the pool imports them while the worker
# reads its weights, so that the first compile does not wait for them.
KERNEL_MODULES = (
    "kernels.lora_shrink",
    "kernels.lora_expand",
    "kernels.lora_expand_act",
    "kernels.lora_fused",
    "kernels.paged_attention",
    "kernels.fp8_gemm",
)


@dataclass(frozen=True)
class Spec:
    """One specialization of one kernel, as the JIT saw it at a launch."""

    module: str
    name: str
    data: str  # Triton's specialization data (JSON): signature, constants, attributes, options, key, target


class TargetDriver:
    """The part of a Triton driver that the JIT asks before it compiles: the device, stream and target.
    Active in the pool's processes (so they never touch a GPU) and wherever variants are recorded or
    compiled for a target named explicitly."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def sources_hash(paths: Iterable[Path], root: Path) -> str:
    """sha256 over the Python sources at `paths`, in the order given (a directory: its *.py files, sorted
    by name), each as its path relative to `root` and then its bytes: an edit, a rename or a move of any
    of them changes it."""
    h = hashlib.sha256()
    for path in paths:
        for f in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def kernel_source_hash() -> str:
    """sha256 over the sources of every kernel module (any edit to a kernel changes it)."""
    return sources_hash([KERNEL_DIR], KERNEL_DIR)


def cache_tag(target: GPUTarget) -> str:
    """The cache's namespace: target (backend and compute capability), Triton version, kernel sources."""
    return f"{target.backend}{target.arch}-triton{triton.__version__}-{kernel_source_hash()[:16]}"


def namespace_cache(target: GPUTarget) -> str:
    """Point TRITON_CACHE_DIR (default Triton's own) at its subdirectory for `target` and these kernels,
    unless it already is there; the pool's processes inherit it. Returns the directory."""
    base = knobs.cache.dir
    tag = cache_tag(target)
    path = base if Path(base).name == tag else os.path.join(base, tag)
    os.environ["TRITON_CACHE_DIR"] = path
    return path


@contextmanager
def recording() -> Iterator[list[Spec]]:
    """Within: every launch of a kernel not yet loaded in this process is recorded (once per
    specialization) instead of compiled and launched. Nothing runs on the device meanwhile."""
    specs: list[Spec] = []
    seen: set[str] = set()

    def hook(*, fn, compile, **_) -> bool:
        data = compile["specialization_data"]
        if data not in seen:
            seen.add(data)
            specs.append(Spec(fn.module, fn.name, data))
        return True  # skip the compile (and so the launch)

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield specs
    finally:
        knobs.runtime.jit_cache_hook = before


@contextmanager
def counting_compiles(
    names: list[str] | None = None, read_seconds: list[float] | None = None
) -> Iterator[list[bool]]:
    """Within: one entry per kernel the JIT compiles or loads in this process, True where it compiled
    (the on-disk cache did not hold it); `names` gets the name of each kernel compiled, `read_seconds`
    the seconds each kernel found in the cache took to read from it (where Triton reports them)."""
    compiled: list[bool] = []
    before = knobs.compilation.listener

    def listen(*, cache_hit: bool, metadata, times=None, **_) -> None:
        compiled.append(not cache_hit)
        if names is not None and not cache_hit:
            names.append(str(metadata.get("name", "?")) if isinstance(metadata, dict) else "?")
        if read_seconds is not None and cache_hit and times is not None:
            # a cache hit ends in the listener before any lowering: all of it counts as IR initialisation
            read_seconds.append(getattr(times, "ir_initialization", 0) / 1e6)

    knobs.compilation.listener = listen
    try:
        yield compiled
    finally:
        knobs.compilation.listener = before


def _child_init(target: tuple, modules: tuple[str, ...]) -> None:
    driver.set_active(TargetDriver(GPUTarget(*target)))
    for m in modules:
        importlib.import_module(m)


def compile_spec(spec: Spec) -> bool:
    """Compile one recorded specialization into the cache (Triton's own `preload`, which builds the same
    source and options as the launch did, for the active driver's target). True: it was compiled, False:
    the cache already held it."""
    fn = getattr(importlib.import_module(spec.module), spec.name)
    with counting_compiles() as compiled:
        fn.preload(spec.data)
    return not compiled or any(compiled)  # no report: counted as compiled


class CompilePool:
    """Processes that compile recorded specializations for one target. Started early (they import torch,
    Triton and the kernels while the caller does other work); `close` ends them."""

    def __init__(self, target: GPUTarget, workers: int | None = None):
        self.target = target
        self.workers = workers or max(1, min(16, os.cpu_count() or 1))
        self._pool = ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),  # the caller may hold a CUDA context
            initializer=_child_init,
            initargs=((target.backend, target.arch, target.warp_size), KERNEL_MODULES),
        )
        for _ in range(self.workers):  # one process starts per task submitted while none is idle: all now
            self._pool.submit(os.getpid)

    def compile(self, specs: list[Spec], on_done: Callable[[], None] | None = None) -> int:
        """Compile `specs` in parallel (a failure raises here, naming the kernel). Returns how many were
        compiled rather than found in the cache."""
        futures = {self._pool.submit(compile_spec, s): s for s in specs}
        compiled = 0
        for f in as_completed(futures):
            try:
                compiled += f.result()
            except Exception as e:
                s = futures[f]
                raise RuntimeError(f"compiling {s.module}.{s.name} failed: {e}") from e
            if on_done is not None:
                on_done()
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
