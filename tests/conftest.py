"""Shared fixtures: tiny generated checkpoints and PEFT adapters (real file layouts, random weights),
written once per test session so transformers, PEFT and lorapipe all load the very same files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.synthetic.adapters import make_adapters  # noqa: E402
from runtime.synthetic.model import make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "llama", arch="llama", preset="tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2", preset="tiny", seed=2)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return make_model(
        tmp_path_factory.mktemp("models") / "mistral",
        arch="mistral",
        preset="tiny",
        seed=3,
        overrides={"sliding_window": 8},
    )


def mixed_adapters(model_dir: Path, out_dir: Path) -> dict[str, Path]:
    """Four adapters that differ in rank (incl. 1 and odd), target set, alpha and rsLoRA."""
    specs = [
        dict(prefix="full8_", ranks=(8,), targets=None, use_rslora=False, alpha=16),
        dict(prefix="qv5_", ranks=(5,), targets=("q_proj", "v_proj"), use_rslora=False, alpha=7),
        dict(
            prefix="mlp1_",
            ranks=(1,),
            targets=("gate_proj", "up_proj", "down_proj"),
            use_rslora=False,
            alpha=2,
        ),
        dict(
            prefix="rs12_", ranks=(12,), targets=("k_proj", "o_proj", "down_proj"), use_rslora=True, alpha=6
        ),
    ]
    out = {}
    for i, spec in enumerate(specs):
        kw = {k: v for k, v in spec.items() if v is not None}
        (path,) = make_adapters(model_dir, out_dir, n=1, seed=100 + i, **kw)
        out[spec["prefix"].rstrip("_")] = path
    return out


@pytest.fixture(scope="session")
def llama_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return mixed_adapters(tiny_llama, tmp_path_factory.mktemp("llama_adapters"))


@pytest.fixture(scope="session")
def qwen2_adapters(tiny_qwen2, tmp_path_factory) -> dict[str, Path]:
    return mixed_adapters(tiny_qwen2, tmp_path_factory.mktemp("qwen2_adapters"))


@pytest.fixture
def recorded_logits(monkeypatch) -> dict[str, list[torch.Tensor]]:
    return record_logits(monkeypatch)


def record_logits(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """Float32 CPU logits of every row the engine samples and keeps, per request id, in step order
    (recorded at the sampler, so tests compare exactly what the engine decided on; a row that an
    overlapped step computed for a request an earlier step had ended is dropped, as the engine drops it)."""
    from stages.worker.executor import StepExecutor
    from stages.worker.sampler import Sampler, request_rows

    seen: dict[str, list[torch.Tensor]] = {}
    issue, finish = Sampler.issue, StepExecutor.finish

    def record_issue(self, logits, request_ids, params, rows=None, **kw):
        sampled = issue(self, logits, request_ids, params, rows, **kw)
        at = request_rows(len(request_ids), rows)  # each request's row of the logits
        sampled.recorded = [logits[i].detach().float().cpu().clone() for i in at]
        return sampled

    def record_finish(self, step):
        outcome = finish(self, step)
        rows = step.sampled.recorded if step.sampled is not None else []
        for (req, _), row in zip(step.rows, rows, strict=True):
            if not req.dropped_from(step.launch):
                seen.setdefault(req.request_id, []).append(row)
        return outcome

    monkeypatch.setattr(Sampler, "issue", record_issue)
    monkeypatch.setattr(StepExecutor, "finish", record_finish)
    return seen


def pool_gb(model_dir: Path, rows: int, max_rank: int = 16) -> float:
    """`lora_gpu_memory_gb` for a GPU adapter pool of `rows` rank rows of this model (its own dtype)."""
    from runtime.common.lora_layout import LoraLayout
    from runtime.common.model_config import ModelConfig, parse_dtype
    from stages.worker.lora.pool import row_bytes

    cfg = ModelConfig.from_dir(model_dir)
    return rows * row_bytes(LoraLayout.for_model(cfg, max_rank), parse_dtype(None, cfg.dtype)) / 2**30


# `lorapipe serve` flags that take no fixed port: a test that checks arguments must not depend on what
# else listens on this machine (start-up refuses a default port another program holds).
NO_FIXED_PORTS = ("--endpoint", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--port", "0")


@pytest.fixture
def default_ports_taken():
    """Holds `serve`'s default ports (client endpoint, metrics, HTTP) where they are free, so that a test
    that relies on them being free fails on every machine, not only where another program has them."""
    import socket

    from runtime.base.endpoints import DEFAULT_CLIENT_PORT
    from runtime.http_args import DEFAULT_PORT
    from runtime.serve_args import DEFAULT_METRICS_PORT

    held = []
    for port in (DEFAULT_CLIENT_PORT, DEFAULT_METRICS_PORT, DEFAULT_PORT):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:  # another program has it already: the test sees it taken all the same
            s.close()
    yield
    for s in held:
        s.close()
