"""On a GPU: a forward gated layer by layer on a slot copy still in flight (the load stream held back by a
sleep kernel) gives the logits of a forward after a finished copy; without the gates the same forward
reads the adapter's rows before its weights arrive and differs (the control that shows the test can fail).
Eagerly, and replaying step graphs: full graphs through their gated twins (external-event wait nodes),
piecewise graphs with the waits between pieces."""

from __future__ import annotations

import pytest
import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HOLD_CYCLES = 300_000_000  # keeps the load stream busy for well over 100 ms before the copy starts


def _forward_during_copy(runner: ModelRunner, packed, seqs, gated: bool) -> torch.Tensor:
    runner.pool.mem[:, : packed.rank].zero_()
    runner.pool.ranks[0].zero_()
    torch.cuda.synchronize()
    load_stream = torch.cuda.Stream()
    with torch.cuda.stream(load_stream):
        torch.cuda._sleep(HOLD_CYCLES)
    events = runner.load_adapter(0, packed, [(0, packed.rank)], stream=load_stream, layer_events=True)
    assert events is not None and len(events) == runner.model_cfg.num_layers
    waits = [[e] for e in events] if gated else None
    logits = runner.execute(seqs, layer_waits=waits)
    if gated:
        # The first layer waited for its own copy; the host returned before the copies were done.
        assert not events[-1].query(), "the copy finished before the forward was even issued"
    torch.cuda.synchronize()
    return logits.cpu()


def test_layer_gated_forward_equals_forward_after_copy(tiny_llama, llama_adapters):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda", dtype="float32",
        max_lora_rank=16, lora_backend="triton", num_pages=64, cuda_graph_max_batch=0,
        layered_min_bytes=0,  # as a server with overlapped loading: any adapter may be copied by layer
    )  # fmt: skip
    runner = ModelRunner(cfg)
    name, path = next(iter(llama_adapters.items()))
    packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=True)
    seqs = [SeqInput([5, 17, 42, 99, 3, 8, 250, 11], 0, [0, 1], 0), SeqInput([7, 9, 4], 0, [2], -1)]
    runner.load_adapter(0, packed, [(0, packed.rank)])
    torch.cuda.synchronize()
    want = runner.execute(seqs).cpu()

    got = _forward_during_copy(runner, packed, seqs, gated=True)
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert err < 1e-5, f"layer-gated forward differs from the forward after the copy: {err:.2e}"

    stale = _forward_during_copy(runner, packed, seqs, gated=False)
    assert ((stale[0] - want[0]).norm() / want[0].norm()).item() > 1e-3, "ungated forward saw the adapter"
    torch.testing.assert_close(stale[1], want[1])  # the base-only row never reads the pool


@pytest.mark.parametrize("attention", ["triton", "torch"], ids=["full", "piecewise"])
def test_layer_gated_step_graph_equals_replay_after_copy(tiny_llama, llama_adapters, attention):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda", dtype="float32", max_lora_rank=16, lora_backend="triton",
        attention_backend=attention, num_pages=64, max_tokens_per_step=64, cuda_graph_max_tokens=32,
        layered_min_bytes=0,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    steps = runner.step_graphs
    assert steps is not None and steps.piecewise == (attention == "torch")
    if not steps.piecewise:  # every LoRA key has a gated twin
        lora_keys = {k[:3] for k in steps.full if k[2]}
        assert lora_keys and {k[:3] for k in steps.full if k[3]} == lora_keys
    name, path = next(iter(llama_adapters.items()))
    packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=True)
    seqs = [SeqInput([5, 17, 42, 99, 3, 8, 250, 11], 0, [0, 1], 0), SeqInput([7, 9, 4], 0, [2], -1)]
    runner.load_adapter(0, packed, [(0, packed.rank)])
    torch.cuda.synchronize()
    replays = steps.replays
    want = runner.execute(seqs).cpu()
    assert steps.replays == replays + 1 and steps.gated_runs == 0

    got = _forward_during_copy(runner, packed, seqs, gated=True)
    assert steps.replays == replays + 2 and steps.gated_runs == 1, "the gated step did not replay"
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert err < 1e-5, f"layer-gated replay differs from the replay after the copy: {err:.2e}"

    stale = _forward_during_copy(runner, packed, seqs, gated=False)
    assert steps.replays == replays + 3
    assert ((stale[0] - want[0]).norm() / want[0].norm()).item() > 1e-3, "ungated replay saw the adapter"
    torch.testing.assert_close(stale[1], want[1])
