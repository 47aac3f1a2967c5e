"""The Triton backend's "fold" design on CUDA, through the worker's decode CUDA graph: a decode step's
logits against the "serial" design's (the same adapters, the same step), within bf16 rounding of the LoRA
change itself; Llama-1B widths over two layers, adapters of ranks 1, 7, 16 and 80 (block rank 128) at
scattered pool rows, base-only sequences among them; bf16 and e4m3 pools; o's shrink beside the O
projection and in stream order."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_lora_decode import PAGE, random_model, step_runner
from benchmarks.bench_lora_step import make_pool
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.model import build_config
from stages.worker.lora.fold import FOLD_SIDE_ENV
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.model.kv_cache import KVCache
from stages.worker.seq_input import SeqInput
from tests.kernels.conftest import TOL, rel_err

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]

CTX = 64


def _model():
    d = build_config("llama", "1b", dtype="bfloat16")
    d.update(num_hidden_layers=2, vocab_size=8192)
    cfg = ModelConfig.from_dict(d)
    return random_model(cfg, torch.device("cuda"), seed=3), cfg


@pytest.mark.parametrize(
    "lora_dtype,batch,side",
    [("auto", 16, True), ("auto", 16, False), ("auto", 40, True), ("fp8", 16, True), ("fp8", 40, False)],
)
def test_fold_logits_match_serial(lora_dtype, batch, side, monkeypatch):
    """`side`: o's shrink beside the O projection on a side stream (the default), else in stream order."""
    monkeypatch.setenv(FOLD_SIDE_ENV, "1" if side else "0")
    model, cfg = _model()
    dev = torch.device("cuda")
    layout = LoraLayout.for_model(cfg, 80)
    model.lora_layout = layout
    pool, _ = make_pool(layout, 256 << 20, 4, [16, 1, 80, 7], dev, seed=5, lora_dtype=lora_dtype)
    # rows 4x the benchmark's (16x the delta): the LoRA change of the bf16 logits then stands far above
    # their rounding (2^-8 at magnitude 1), which bounds how closely two designs can agree
    (pool.mem if pool.scales is None else pool.scales).mul_(4)
    pages = CTX // PAGE + 2
    kv = KVCache(
        num_layers=cfg.num_layers, num_pages=batch * pages, page_size=PAGE, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=torch.bfloat16, device=dev,
    )  # fmt: skip

    def seqs(lora: bool) -> list[SeqInput]:
        """Sequence i on id i % 5 - 1 (-1: base-only), or all base-only; sorted by id, as the runner
        orders them (stably: the base-only step's rows stay in sequence order)."""
        out = [
            SeqInput([7 + i], CTX, list(range(i * pages, (i + 1) * pages)), i % 5 - 1 if lora else -1)
            for i in range(batch)
        ]
        return sorted(out, key=lambda s: s.slot)

    _, base = step_runner(model, kv, None, seqs(False), CTX, True, "base-only")
    logits = {}
    for design in ("serial", "fold"):
        backend = TritonLoraBackend(pool, max_tokens=2048, max_seqs=64, design=design)
        _, logits[design] = step_runner(model, kv, backend, seqs(True), CTX, True, design)
        if design == "fold":
            assert backend.folds() is not None and backend.folds().side_o == side  # the step ran them
    base = base[torch.tensor(sorted(range(batch), key=lambda i: i % 5 - 1))]  # rows in the LoRA steps' order
    serial, fold = logits["serial"], logits["fold"]
    assert torch.isfinite(fold).all()
    change = serial - base
    assert change.abs().max() > 0.05  # the adapters move the logits well past rounding
    assert rel_err(fold - base, change) < 2 * TOL[torch.bfloat16]
