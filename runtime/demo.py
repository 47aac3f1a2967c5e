"""`lorapipe demo`: makes a tiny model and a few adapters if absent, runs a mixed-adapter batch
(every request its own adapter, some none) through the offline engine and prints the completions."""

from __future__ import annotations

import time
from pathlib import Path

from proto.sampling import SamplingParams
from runtime.offline import LLM

PROMPTS = [
    "The river carried the boat",
    "A quiet morning in the village",
    "Stories begin when",
    "The engine hummed while",
    "Numbers: one two three",
    "héllo wörld",
]


def ensure_demo_files(root: Path) -> tuple[Path, dict[str, Path]]:
    from tools.make_adapters import make_adapters
    from tools.make_tiny_model import make_model

    model = root / "model"
    if not (model / "config.json").exists():
        make_model(model, arch="llama", preset="tiny", seed=0)
    adapters = {}
    for i, (rank, targets) in enumerate([(8, None), (4, ("q_proj", "v_proj")), (3, ("gate_proj", "up_proj"))]):
        path = root / "adapters" / f"demo{i}"
        if not (path / "adapter_config.json").exists():
            kw = {"targets": targets} if targets else {}
            (made,) = make_adapters(model, root / "adapters", n=1, ranks=(rank,), seed=i, prefix=f"demo{i}", **kw)
            made.rename(path)
        adapters[f"demo{i}"] = path
    return model, adapters


def run_demo(root: Path, device: str = "cpu") -> int:
    model, adapters = ensure_demo_files(root)
    llm = LLM(model, adapters=adapters, device=device, max_loras_per_batch=2, max_lora_rank=16)
    names = [*adapters, None, *adapters]
    mix = [names[i % len(names)] for i in range(len(PROMPTS))]
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, adapters=mix, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    took = time.perf_counter() - start
    print(f"model: {model} ({llm.runner.model_cfg.architecture}), {len(adapters)} adapters, 2 slots")
    print(f"{'adapter':<8} {'finish':<7} prompt → completion")
    for out, prompt in zip(outs, PROMPTS, strict=True):
        print(f"{out.adapter or '-':<8} {out.finish_reason:<7} {prompt!r} → {out.text!r}")
    tokens = sum(len(o.token_ids) for o in outs)
    s = llm.last_stats
    print(f"{tokens} tokens in {took:.2f}s, {s.steps} steps, {s.adapter_loads} adapter loads")
    return 0
