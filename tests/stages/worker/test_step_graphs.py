"""The fixed-shape path that the step CUDA graphs replay (steps with prefill tokens, padded to a token
bucket), run eagerly on the CPU (Triton interpreter) in both modes, full and piecewise: mixed prefill and
decode batches give the logits of the plain path (torch attention loop, torch LoRA backend), padding
writes only to the KV cache's scratch page, and unsupported batches fall back to the eager path."""

from __future__ import annotations

import pytest
import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.lora.backend import slot_segments
from stages.worker.lora.torch_backend import TorchLoraBackend
from stages.worker.model.llama import LlamaModel
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from stages.worker.step_graphs import StepGraphs
from stages.worker.step_inputs import token_buckets
from tests.stages.worker.graph_tolerances import KV_ATOL, TOL

PAGE = 4
MAX_LEN = 96
MAX_TOKENS = 64  # buckets 16, 32, 64
MAX_SEQS = 12


def test_token_buckets():
    b = token_buckets(8192)
    assert b[:4] == [16, 32, 64, 128] and b[-1] == 8192 and b == sorted(set(b))
    assert all(b2 - b1 <= b1 // 4 for b1, b2 in zip(b, b[1:], strict=False) if b1 >= 1024)
    assert token_buckets(40) == [16, 32, 40] and token_buckets(8) == [8]


@pytest.fixture(scope="module")
def engine(tiny_llama, llama_adapters):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32",
        max_lora_rank=16, lora_backend="triton", attention_backend="triton", page_size=PAGE, num_pages=400,
        max_tokens_per_step=128, max_running_requests=MAX_SEQS,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    for slot, (name, path) in enumerate(llama_adapters.items()):  # ranks 8, 5, 1 and 12
        packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(16 * slot, packed.rank)])
    torch_model = LlamaModel(runner.model_cfg, runner.model.w, runner.lora_layout, attention_backend="torch")
    kw = dict(max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS, max_model_len=MAX_LEN, capture=False)
    modes = {
        "full": StepGraphs(runner.model, runner.kv, runner.lora, piecewise=False, **kw),
        "piecewise": StepGraphs(runner.model, runner.kv, runner.lora, piecewise=True, **kw),
        "piecewise-torch": StepGraphs(torch_model, runner.kv, runner.lora, piecewise=True, **kw),
    }
    return runner, modes, TorchLoraBackend(runner.pool, cfg.max_tokens_per_step), torch_model


def _batch(runner: ModelRunner, spec: list[tuple[int, int, int]], seed: int) -> list[SeqInput]:
    """One sequence per (context already cached, new tokens, slot): the context is prefilled eagerly
    first; returns the step's inputs ordered by slot (each adapter's tokens contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    seqs, warm, next_page = [], [], 0
    for ctx, n, slot in spec:
        tokens = torch.randint(2, 250, (ctx + n,), generator=gen).tolist()
        pages = list(range(next_page, next_page + -(-(ctx + n) // PAGE)))
        next_page = pages[-1] + 1
        if ctx:
            warm.append(SeqInput(tokens[:ctx], 0, pages, slot))
        seqs.append(SeqInput(tokens[ctx:], ctx, pages, slot))
    if warm:
        runner._forward_eager(sorted(warm, key=lambda s: s.slot))
    return sorted(seqs, key=lambda s: s.slot)


def _reference(runner: ModelRunner, torch_model, torch_lora, seqs: list[SeqInput]) -> torch.Tensor:
    """The plain path: the same weights with the torch attention loop and the torch LoRA backend."""
    fb, indptr, slots = runner._build_batch(seqs)
    torch_lora.prepare(indptr, slots)
    with torch.inference_mode():
        return torch_model.forward(fb, runner.kv, torch_lora if any(s >= 0 for s in slots) else None)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


BATCHES = {
    # (context already cached, new tokens, slot): prefill chunks from 0 and continuing, and decodes
    "mixed14": [(0, 7, 0), (9, 1, 1), (9, 5, -1), (3, 1, 3)],  # bucket 16
    "at32": [(0, 12, 2), (5, 1, 0), (0, 9, 1), (11, 8, 3), (7, 1, -1), (2, 1, 2)],  # exactly bucket 32
    "past33": [(0, 12, 2), (5, 1, 0), (0, 9, 1), (11, 8, 3), (7, 2, -1), (2, 1, 2)],  # 33: bucket 64
    "base": [(0, 10, -1), (6, 1, -1), (4, 3, -1)],  # base-only, bucket 16
    "run40": [(0, 40, 1), (8, 1, 1), (0, 3, 0)],  # one adapter run over two LoRA tiles, bucket 64
    "decode": [(5 + i, 1, i % 5 - 1) for i in range(12)],  # pure decode, the most sequences
}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_padded_step_equals_plain_path(engine, mode, name):
    runner, modes, torch_lora, torch_model = engine
    graphs = modes[mode]
    seqs = _batch(runner, BATCHES[name], seed=len(name))
    want = _reference(runner, torch_model, torch_lora, seqs)
    kv_k, kv_v = runner.kv.k.clone(), runner.kv.v.clone()
    assert graphs.supports(seqs)
    total = sum(len(s.token_ids) for s in seqs)
    padded = graphs.bucket(total)
    assert padded == {"at32": 32, "past33": 64}.get(name, padded)
    got = graphs.run(seqs)
    assert got.shape == want.shape
    err = _rel_err(got, want)
    assert err < TOL, f"relative error {err:.2e}"
    # The padded step rewrote only its own rows (same values) and the scratch page.
    scratch = slice(runner.kv.scratch_row, runner.kv.scratch_row + PAGE)
    for new, old in ((runner.kv.k, kv_k), (runner.kv.v, kv_v)):
        new, old = new.clone(), old.clone()
        new[:, scratch], old[:, scratch] = 0, 0
        torch.testing.assert_close(new, old, rtol=TOL, atol=KV_ATOL)
    if padded > total:
        assert runner.kv.k[:, scratch].abs().sum() > 0, "padding tokens wrote nowhere visible"


def test_piecewise_with_the_torch_attention_loop(engine):
    """Attention that reads each batch's extents on the host runs eagerly between the graph pieces."""
    runner, modes, torch_lora, torch_model = engine
    seqs = _batch(runner, BATCHES["past33"], seed=5)
    want = _reference(runner, torch_model, torch_lora, seqs)
    err = _rel_err(modes["piecewise-torch"].run(seqs), want)
    assert err < TOL, f"relative error {err:.2e}"


def test_padding_rows_never_read_uninitialised_memory(engine, monkeypatch):
    """Every fresh float buffer starts as NaN here (what torch.empty may hand out): the padded step must
    still give finite logits for all rows and leave only finite K/V in the scratch page."""
    runner, modes, _, _ = engine
    seqs = _batch(runner, [(0, 5, 1), (4, 1, -1), (0, 3, 0)], seed=77)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    for graphs in (modes["full"], modes["piecewise"]):
        graphs.run(seqs)
        assert torch.isfinite(graphs.out[: graphs.inputs.out_rows(16)]).all(), "a padding row read NaN"
    scratch = slice(runner.kv.scratch_row, runner.kv.scratch_row + PAGE)
    assert torch.isfinite(runner.kv.k[:, scratch]).all() and torch.isfinite(runner.kv.v[:, scratch]).all()


@pytest.mark.parametrize("splits", [2, 4])
def test_forced_key_splits_give_the_same_logits(engine, splits):
    """Full graphs are captured for every split count a bucket may choose; each must be exact."""
    runner, modes, torch_lora, torch_model = engine
    graphs = modes["full"]
    seqs = _batch(runner, [(30, 4, 0), (0, 6, -1), (50, 1, 3)], seed=40 + splits)
    want = _reference(runner, torch_model, torch_lora, seqs)
    step = graphs.inputs.stage(seqs, 16)
    graphs.lora.prepare(*slot_segments(seqs), pad_to=16, block_m=16)
    graphs._forward_full((step.padded, splits, True, False))
    err = _rel_err(graphs.out[: len(seqs)], want)
    assert err < TOL, f"relative error {err:.2e}"


def test_unsupported_batches_fall_back(engine):
    runner, modes, torch_lora, torch_model = engine
    graphs = modes["full"]
    assert not graphs.supports([])
    assert not graphs.supports([SeqInput([1] * 65, 0, list(range(17)), -1)])  # beyond the largest bucket
    assert not graphs.supports([SeqInput([1], 3, [i], -1) for i in range(MAX_SEQS + 1)])  # too many
    assert not graphs.supports([SeqInput([1, 2], MAX_LEN - 1, list(range(25)), -1)])  # past the table
    no_lora = StepGraphs(
        graphs.model, graphs.kv, None, max_tokens=32, max_seqs=4, max_model_len=MAX_LEN, piecewise=False,
        capture=False,
    )  # fmt: skip
    assert not no_lora.supports([SeqInput([1, 2], 3, [0, 1], 0)])
    assert no_lora.supports([SeqInput([1, 2], 3, [0, 1], -1)])
    # In the runner: a supported step runs on the graphs' path, an unsupported one eagerly, both exact.
    runner.step_graphs = graphs
    try:
        for spec, on_graphs in (([(0, 9, 2), (3, 1, -1)], True), ([(0, 70, 1), (3, 1, 0)], False)):
            seqs = _batch(runner, spec, seed=3)
            want = _reference(runner, torch_model, torch_lora, seqs)
            runs = graphs.runs
            got = runner.execute(seqs)
            assert graphs.runs == runs + on_graphs
            assert _rel_err(got, want) < TOL
    finally:
        runner.step_graphs = None


@pytest.mark.parametrize("sms", [4, 132])  # the CPU's stand-in count and an H100's
def test_every_step_finds_a_graph_captured_at_start(engine, monkeypatch, sms):
    """The key of every full-graph step (bucket, key splits, adapters present, gated) is among the keys
    captured before serving: a step outside them would capture, and compile kernels, while serving.
    Contexts from 1 key to the page table's reach, so every split count the heuristic picks shows up."""
    import random

    from kernels import device_info

    monkeypatch.setattr(device_info, "num_sms", lambda device: sms)
    runner = engine[0]
    graphs = StepGraphs(
        runner.model, runner.kv, runner.lora, max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS,
        max_model_len=400 * PAGE, piecewise=False, capture=False,
    )  # fmt: skip
    keys, seen = set(graphs.graph_keys()), set()
    rng = random.Random(sms)
    for _ in range(400):
        seqs, budget = [], rng.randint(1, MAX_TOKENS)
        while budget > 0 and len(seqs) < MAX_SEQS:
            n = rng.randint(1, budget)
            ctx = rng.choice([0, rng.randint(0, 40), rng.randint(0, graphs.max_keys - n)])
            pages = list(range(-(-(ctx + n) // PAGE)))
            seqs.append(SeqInput([7] * n, ctx, pages, rng.randint(-1, 3)))
            budget -= n
        seqs.sort(key=lambda s: s.slot)
        padded = graphs.bucket(sum(len(s.token_ids) for s in seqs))
        splits = graphs._splits(graphs.inputs.stage(seqs, padded))
        key = (padded, splits, any(s.slot >= 0 for s in seqs), False)  # ungated (no copies in flight)
        assert key in keys, f"a step needs graph {key}, not captured at start-up"
        seen.add(key[1])
    assert len(seen) > 1 or sms == 4  # the H100's count makes long contexts split
