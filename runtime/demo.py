"""`lorapipe demo`: makes a tiny model and a few adapters if absent, launches the pipeline (more adapters
than its GPU adapter pool holds), streams a mixed-adapter set of requests through the SDK, prints the
completions, one line of what the server counted (from `/metrics`) and how to serve the same files, and
shuts down."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from pathlib import Path

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from runtime.base.endpoints import free_port
from runtime.client import AsyncClient
from runtime.launcher import Launcher, LaunchError
from runtime.serve_args import ServeArgs

PROMPTS = [
    "The river carried the boat",
    "A quiet morning in the village",
    "Stories begin when",
    "The engine hummed while",
    "Numbers: one two three",
    "héllo wörld",
]
DEMO_MODEL_NAME = "tiny"  # what HTTP requests name the demo's base model (the README's examples)
RANDOM_WEIGHTS = (
    "The demo model and its adapters have seeded random weights (made by runtime/synthetic): the\n"
    "completions below are meant to be gibberish. The demo shows the pipeline, not a language model."
)
# what the summary line counts: (label, metric family, its labels or None for all)
_COUNTED = (
    ("steps", "lorapipe_plans", None),
    ("adapter reads from disk", "lorapipe_adapter_loads", {"result": "staged"}),
    ("copies into the adapter pool", "lorapipe_slot_loads", None),
)


def ensure_demo_files(root: Path) -> tuple[Path, dict[str, Path]]:
    """The demo's model and adapters under `root`, made where missing (only making them imports torch:
    a demo run on files already made spawns its server as quickly as `serve`)."""
    model = root / "model"
    if not (model / "config.json").exists():
        from runtime.synthetic.model import make_model

        make_model(model, arch="llama", preset="tiny", seed=0)
    adapters = {}
    specs = [(8, None), (4, ("q_proj", "v_proj")), (3, ("gate_proj", "up_proj"))]
    for i, (rank, targets) in enumerate(specs):
        path = root / "adapters" / f"demo{i}"
        if not (path / "adapter_config.json").exists():
            from runtime.synthetic.adapters import make_adapters

            kw = {"targets": targets} if targets else {}
            (made,) = make_adapters(
                model, root / "adapters", n=1, ranks=(rank,), seed=i, prefix=f"demo{i}", **kw
            )
            made.rename(path)
        adapters[f"demo{i}"] = path
    return model, adapters


def run_demo(root: Path, device: str = "cpu", max_tokens: int = 12) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model, adapters = ensure_demo_files(root)
    args = ServeArgs(
        model=str(model),
        adapters=tuple((name, str(path)) for name, path in adapters.items()),
        adapter_root=str(root / "adapters"),  # runtime loads read only the demo's adapters
        device=device,
        max_loras_per_batch=2,
        max_cpu_loras=3,
        max_lora_rank=16,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        metrics_port=0,
        port=0,  # the demo streams through the SDK; no HTTP server
        log_file=str(root / "serve.log"),
        drain_timeout_s=10.0,
    )
    return uvloop.run(_demo(args, max_tokens))


async def _demo(args: ServeArgs, max_tokens: int) -> int:
    t0 = time.perf_counter()
    launcher = Launcher(args)
    try:
        async with launcher:
            took = time.perf_counter() - t0
            print(f"pipeline up in {took:.1f}s: tokenizer, scheduler, adapter-loader and worker processes")
            code = await _workload(launcher, max_tokens)
    except LaunchError as exc:
        print(f"the pipeline did not start: {exc} (stage logs: {args.log_file})")
        return 1
    if launcher.failure:
        print(f"the pipeline failed: {launcher.failure} (stage logs: {args.log_file})")
        return 1
    print(f"shut down cleanly\n\n{serve_hint(args)}")
    return code


async def _workload(launcher: Launcher, max_tokens: int) -> int:
    args = launcher.args
    names = [*dict(args.adapters), None]
    mix = [names[i % len(names)] for i in range(len(PROMPTS))]
    device = args.resolved_device()
    memory = "GPU memory" if device == "cuda" else f"{device} memory"
    print(
        f"{len(args.adapters)} adapters, at most {args.max_loras_per_batch} per step from the adapter pool "
        f"in {memory}, at most {args.max_cpu_loras} in the host cache"
    )
    print(RANDOM_WEIGHTS)
    assert launcher.endpoints is not None
    async with AsyncClient(launcher.endpoints.client, timeout=60.0) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(_stream(client, p, a, max_tokens) for p, a in zip(PROMPTS, mix, strict=True)),
            return_exceptions=True,
        )
        took = time.perf_counter() - t0
    print(f"\n{'adapter':<8} {'ttft':>7} {'finish':<7} prompt → completion")
    failed = 0
    for prompt, adapter, out in zip(PROMPTS, mix, outs, strict=True):
        if isinstance(out, BaseException):
            failed += 1
            print(f"{adapter or '-':<8} {'':>7} {'ERROR':<7} {prompt!r}: {type(out).__name__}: {out}")
        else:
            text, ttft, reason = out
            print(f"{adapter or '-':<8} {ttft * 1e3:5.0f}ms {reason:<7} {prompt!r} → {text!r}")
    print(f"{len(PROMPTS) - failed}/{len(PROMPTS)} requests completed in {took:.2f}s")
    if launcher.metrics_url:
        print(summarize(await asyncio.to_thread(_get, launcher.metrics_url)))
    return 1 if failed else 0


async def _stream(
    client: AsyncClient, prompt: str, adapter: str | None, max_tokens: int
) -> tuple[str, float, str]:
    """Streams one request; returns (text, seconds to the first chunk, finish reason)."""
    parts, ttft, reason = [], 0.0, ""
    async for chunk in client.stream(prompt, adapter, max_tokens=max_tokens, ignore_eos=True):
        ttft = ttft or chunk.time
        parts.append(chunk.text)
        reason = chunk.finish_reason or reason
    return "".join(parts), ttft, reason


def summarize(exposition: str) -> str:
    """One line of what the server counted over the run (every counter: its `/metrics`)."""
    found = dict.fromkeys([label for label, _, _ in _COUNTED], 0.0)
    for fam in text_string_to_metric_families(exposition):
        for label, name, labels in _COUNTED:
            if fam.name == name:
                found[label] += sum(
                    s.value
                    for s in fam.samples
                    if s.name.endswith("_total") and (labels is None or labels.items() <= s.labels.items())
                )
    return ", ".join(f"{v:.0f} {label}" for label, v in found.items())


def serve_hint(args: ServeArgs) -> str:
    """The `lorapipe serve` command that serves the demo's files, as the README's examples expect."""
    adapters = " ".join(f"--adapter {name}={path}" for name, path in args.adapters)
    return (
        "Serve these files yourself (the server holds its terminal; Ctrl-C stops it):\n"
        f"  lorapipe serve --model {args.model} --device {args.resolved_device()} "
        f"--served-model-name {DEMO_MODEL_NAME} --adapter-root {args.adapter_root} {adapters}"
    )


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()
