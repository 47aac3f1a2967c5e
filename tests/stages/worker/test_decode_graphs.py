"""The fixed-shape decode path that CUDA graphs replay, run eagerly on the CPU (Triton interpreter):
padded batches give the logits of the plain path (torch attention loop, torch LoRA backend), padding
writes only to the KV cache's scratch page, and every split count and adapter mix is served."""

from __future__ import annotations

import pytest
import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.decode_graphs import DecodeGraphs, batch_buckets
from stages.worker.lora.torch_backend import TorchLoraBackend
from stages.worker.model.llama import LlamaModel
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from tests.stages.worker.graph_tolerances import KV_ATOL, TOL

PAGE = 4
MAX_LEN = 96


def test_buckets_cover_every_size_once():
    b = batch_buckets(300)
    assert b[:4] == [1, 2, 4, 8] and b[-1] == 300 and b == sorted(set(b))
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


@pytest.fixture(scope="module")
def engine(tiny_llama, llama_adapters):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32",
        max_lora_rank=16, lora_backend="triton", attention_backend="triton", page_size=PAGE, num_pages=400,
        max_tokens_per_step=512,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    for slot, (name, path) in enumerate(llama_adapters.items()):
        packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(16 * slot, packed.rank)])
    graphs = DecodeGraphs(
        runner.model, runner.kv, runner.lora, max_batch=24, max_model_len=MAX_LEN, capture=False
    )
    return runner, graphs, TorchLoraBackend(runner.pool, cfg.max_tokens_per_step)


def _prefill(runner: ModelRunner, slots: list[int], seed: int) -> list[SeqInput]:
    """Prefill one sequence per slot entry (lengths 1..37) and return their next decode inputs."""
    gen = torch.Generator().manual_seed(seed)
    seqs, next_page = [], 0
    for i, slot in enumerate(slots):
        n = 1 + (i * 7 + seed) % 37
        prompt = torch.randint(2, 250, (n,), generator=gen).tolist()
        pages = list(range(next_page, next_page + (n + 1 + PAGE - 1) // PAGE + 1))
        next_page = pages[-1] + 1
        seqs.append(SeqInput(prompt, 0, pages, slot))
    runner._forward_eager(sorted(seqs, key=lambda s: s.slot))
    return [SeqInput([3 + i], len(s.token_ids), s.page_ids, s.slot) for i, s in enumerate(seqs)]


def _reference(runner: ModelRunner, torch_lora, seqs: list[SeqInput]) -> torch.Tensor:
    """The plain path: the same weights with the torch attention loop and the torch LoRA backend."""
    model = LlamaModel(runner.model_cfg, runner.model.w, runner.lora_layout, attention_backend="torch")
    fb, indptr, slots = runner._build_batch(seqs)
    torch_lora.prepare(indptr, slots)
    lora = torch_lora if any(s >= 0 for s in slots) else None
    with torch.inference_mode():
        return model.forward(fb, runner.kv, lora)


@pytest.mark.parametrize(
    "slots",
    [
        [0, 1, -1],  # bucket 4
        [2, 2, 3, -1, 0],  # bucket 8
        [-1] * 6,  # base-only
        [1] * 17 + [0],  # one adapter run longer than a LoRA tile, bucket 24
        [3, 0, 1, 2, -1, 1, 0, 2, 3, 3, 0, 1, 2],  # every slot, bucket 16
    ],
    ids=["3", "5", "base6", "run17", "13"],
)
def test_padded_decode_equals_plain_path(engine, slots):
    runner, graphs, torch_lora = engine
    seqs = sorted(_prefill(runner, slots, seed=len(slots)), key=lambda s: s.slot)
    want = _reference(runner, torch_lora, seqs)
    kv_k, kv_v = runner.kv.k.clone(), runner.kv.v.clone()
    assert graphs.supports(seqs)
    got = graphs.run(seqs)
    assert got.shape == want.shape
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert err < TOL, f"relative error {err:.2e}"
    # The padded step rewrote only its own rows (same values) and the scratch page.
    scratch = slice(runner.kv.scratch_row, runner.kv.scratch_row + PAGE)
    for new, old in ((runner.kv.k, kv_k), (runner.kv.v, kv_v)):
        new, old = new.clone(), old.clone()
        new[:, scratch], old[:, scratch] = 0, 0
        torch.testing.assert_close(new, old, rtol=TOL, atol=KV_ATOL)
    padded = graphs.bucket(len(seqs))
    if padded > len(seqs):
        assert runner.kv.k[:, scratch].abs().sum() > 0, "padding tokens wrote nowhere visible"


def test_padding_rows_never_read_uninitialised_memory(engine, monkeypatch):
    """Every fresh float buffer starts as NaN here (what torch.empty may hand out): the padded step must
    still give finite logits for all rows and leave only finite K/V in the scratch page."""
    runner, graphs, _ = engine
    seqs = sorted(_prefill(runner, [1, -1, 0], seed=77), key=lambda s: s.slot)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    padded = graphs.bucket(len(seqs))
    assert padded > len(seqs)
    graphs.run(seqs)
    assert torch.isfinite(graphs.out[:padded]).all(), "a padding row computed from uninitialised memory"
    scratch = slice(runner.kv.scratch_row, runner.kv.scratch_row + PAGE)
    assert torch.isfinite(runner.kv.k[:, scratch]).all() and torch.isfinite(runner.kv.v[:, scratch]).all()


@pytest.mark.parametrize("splits", [2, 8])
def test_forced_key_splits_give_the_same_logits(engine, splits):
    """Graphs are captured for every split count a bucket may choose; each must be exact."""
    runner, graphs, torch_lora = engine
    seqs = sorted(_prefill(runner, [0, -1, 3], seed=40 + splits), key=lambda s: s.slot)
    want = _reference(runner, torch_lora, seqs)
    key = graphs._stage(seqs, graphs.bucket(len(seqs)), splits=splits)
    assert key[1] == splits
    graphs._forward(key)
    got = graphs.out[: len(seqs)]
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert err < TOL, f"relative error {err:.2e}"


def test_unsupported_batches_fall_back(engine):
    _, graphs, _ = engine
    assert not graphs.supports([])
    assert not graphs.supports([SeqInput([1, 2], 0, [0], -1)])  # a prefill
    assert not graphs.supports([SeqInput([1], 0, [0], -1)] * 25)  # beyond max_batch
    assert not graphs.supports([SeqInput([1], MAX_LEN, list(range(30)), -1)])  # beyond the page table
    no_lora = DecodeGraphs(graphs.model, graphs.kv, None, max_batch=4, max_model_len=MAX_LEN, capture=False)
    assert not no_lora.supports([SeqInput([1], 3, [0], 0)])
    assert no_lora.supports([SeqInput([1], 3, [0], -1)])


@pytest.mark.parametrize("sms", [4, 132])  # the CPU's stand-in count and an H100's
def test_every_batch_finds_a_graph_captured_at_start(engine, monkeypatch, sms):
    """The key of every decode batch (bucket, key splits, adapters present) is among the keys captured
    before serving (a batch outside them would capture, and compile kernels, while serving): contexts
    from 1 key to the page table's reach."""
    import random

    from kernels import device_info

    monkeypatch.setattr(device_info, "num_sms", lambda device: sms)
    runner = engine[0]
    graphs = DecodeGraphs(
        runner.model, runner.kv, runner.lora, max_batch=24, max_model_len=1600, capture=False
    )
    keys, seen = set(graphs.graph_keys()), set()
    rng = random.Random(sms)
    for _ in range(300):
        seqs = []
        for _ in range(rng.randint(1, 24)):
            ctx = rng.choice([0, rng.randint(0, 40), rng.randint(0, 1599)])
            seqs.append(SeqInput([7], ctx, list(range(ctx // PAGE + 1)), rng.randint(-1, 3)))
        seqs.sort(key=lambda s: s.slot)
        key = graphs._stage(seqs, graphs.bucket(len(seqs)))
        assert key in keys, f"a batch needs graph {key}, not captured at start-up"
        seen.add(key[1])
    assert len(seen) > 1 or sms == 4  # the H100's count makes long contexts split
