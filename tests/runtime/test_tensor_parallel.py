"""Tensor-parallel offline engine (gloo, two processes on the CPU): every float32 logit of a batch that
mixes adapters of ranks 1, 5, 8 and 12 (an odd rank, rank 1, different target sets) with base-only
requests matches transformers + PEFT and the one-rank engine within 1e-4, with the same greedy tokens;
each rank's slot copy holds exactly its S-LoRA shard of the PEFT tensors; bad sizes and a dead rank fail
clearly without leaving a process behind."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from proto.sampling import SamplingParams
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, ModelConfigError
from runtime.offline import LLM
from runtime.synthetic.model import TINY_VOCAB, make_model
from stages.loader.adapter_reader import read_adapter
from stages.worker.lora.pool import row_bytes
from stages.worker.tp.lora_shard import AdapterSharder
from stages.worker.tp.ranks import RankFailed
from stages.worker.tp.shard import shard_config
from tests.conftest import mixed_adapters
from tests.peft_reference import PeftReference
from tests.runtime.test_offline_vs_peft import PROMPTS

TOL = 1e-4
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """Biases on every projection (O's and down's live on rank 0 only) and a vocabulary that two ranks
    split unevenly (the last rank's rows padded)."""
    root = tmp_path_factory.mktemp("tp_biased")
    model = make_model(
        root / "llama",
        arch="llama",
        preset="tiny",
        seed=7,
        overrides={"attention_bias": True, "mlp_bias": True, "vocab_size": TINY_VOCAB + 1},
    )
    return model, mixed_adapters(model, root / "adapters")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _generate(model_dir, adapters, recorded, tp: int, **kw):
    names = list(adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    recorded.clear()
    kw = {"max_lora_rank": 16, "device": "cpu"} | kw
    with LLM(model_dir, adapters=adapters, dtype="float32", tensor_parallel_size=tp, **kw) as llm:
        outs = llm.generate(PROMPTS, adapters=mix, sampling=SAMPLING)
        _generate.last_stats = llm.last_stats
        graphs = llm.runner.graphs
        _generate.last_replays = graphs.replays if graphs is not None else 0
        procs = list(llm.ranks.procs) if llm.ranks is not None else []
    assert all(p.poll() is not None for p in procs), "a rank outlived close()"
    rows = [recorded[rid] for rid in sorted(recorded, key=lambda rid: int(rid[1:]))]
    return mix, outs, rows


def _check(model_dir, adapters, recorded, pool_rows: int | None = None, tol: float = TOL, **kw):
    """`pool_rows`: a GPU adapter pool of that many rank rows in both engines (a rank's row is a shard)."""
    sized = {}
    if pool_rows is not None:
        cfg = ModelConfig.from_dir(model_dir)
        for tp in (1, 2):
            layout = LoraLayout.for_model(shard_config(cfg, tp), kw.get("max_lora_rank", 16))
            sized[tp] = {"lora_gpu_memory_gb": pool_rows * row_bytes(layout, torch.float32) / 2**30}
    mix, one, one_rows = _generate(model_dir, adapters, recorded, 1, **kw, **sized.get(1, {}))
    _, two, two_rows = _generate(model_dir, adapters, recorded, 2, **kw, **sized.get(2, {}))
    ref = PeftReference(model_dir, adapters)
    assert len(two_rows) == len(PROMPTS)
    for out, base, name, rows, base_rows in zip(two, one, mix, two_rows, one_rows, strict=True):
        assert out.token_ids == base.token_ids, f"adapter {name}: tokens differ from one rank"
        full = out.prompt_token_ids + out.token_ids[:-1]
        want = ref.logits(full, name)[len(out.prompt_token_ids) - 1 :]
        assert len(rows) == len(want) == len(base_rows) == 6
        for step, (got, w, b) in enumerate(zip(rows, want, base_rows, strict=True)):
            assert _rel(got, w) < tol, f"adapter {name} step {step}: {_rel(got, w):.2e} from PEFT"
            assert _rel(got, b) < tol, f"adapter {name} step {step}: {_rel(got, b):.2e} from one rank"
        assert out.token_ids == want.argmax(-1).tolist(), f"adapter {name}: greedy tokens differ from PEFT"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_two_ranks_match_peft_and_one_rank_llama(tiny_llama, llama_adapters, recorded_logits, backend):
    _check(tiny_llama, llama_adapters, recorded_logits, lora_backend=backend, max_loras_per_batch=4)


def test_two_ranks_match_peft_qwen2_tied(tiny_qwen2, qwen2_adapters, recorded_logits):
    _check(tiny_qwen2, qwen2_adapters, recorded_logits, lora_backend="torch")


def test_two_ranks_match_peft_with_biases_and_an_uneven_vocabulary(biased_llama, recorded_logits):
    model, adapters = biased_llama
    _check(model, adapters, recorded_logits, lora_backend="torch")


def test_sharded_loads_under_churn_match_peft(tiny_llama, llama_adapters, recorded_logits):
    # a pool of 13 rank rows for adapters of 26 rows, two adapters a step, KV pressure: sharded copies
    # replace each other in the pool while requests run
    _check(
        tiny_llama,
        llama_adapters,
        recorded_logits,
        pool_rows=13,
        max_lora_rank=12,
        page_size=4,
        num_pages=24,
        lora_backend="torch",
        max_loras_per_batch=2,
        max_running_requests=4,
        max_tokens_per_step=16,
        adapter_affinity_steps=0,  # queue order: the requests alternate adapters
        prefix_caching=False,  # a request resumed from its cached prefix would churn the pool less
    )
    assert _generate.last_stats.adapter_loads > 4, "the two ranks' pools were never churned"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_slot_copy_is_its_slora_shard_of_the_peft_tensors(tiny_qwen2, qwen2_adapters, rank):
    cfg = ModelConfig.from_dir(tiny_qwen2)
    whole, part = LoraLayout.for_model(cfg, 16), LoraLayout.for_model(shard_config(cfg, 2), 16)
    for name, path in qwen2_adapters.items():
        packed = read_adapter(name, path, cfg, whole, torch.float32)
        block = AdapterSharder(whole, part, rank, 2)(packed).block  # [L, r, part.row_elems]
        tensors = load_file(str(path / "adapter_model.safetensors"))
        seen = torch.zeros(part.row_elems, dtype=torch.bool)
        for layer in range(cfg.num_layers):
            for g in part.groups:
                split_in = g.name in ("o", "down")
                for s, module in enumerate(g.modules):
                    a_cols = slice(g.a_offset + s * g.in_stride, g.a_offset + s * g.in_stride + g.in_dim)
                    b_cols = slice(
                        g.b_offset + g.out_offsets[s], g.b_offset + g.out_offsets[s] + g.out_dims[s]
                    )
                    seen[a_cols] = seen[b_cols] = True
                    kind = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                    key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                    if f"{key}.lora_A.weight" not in tensors:
                        assert not block[layer, :, a_cols].any() and not block[layer, :, b_cols].any()
                        continue
                    a, b = tensors[f"{key}.lora_A.weight"].float(), tensors[f"{key}.lora_B.weight"].float()
                    r = a.shape[0]
                    if split_in:  # A by input columns, B whole
                        a = a[:, rank * g.in_dim : (rank + 1) * g.in_dim]
                    else:  # A whole, B by output rows
                        n = g.out_dims[s]
                        b = b[rank * n : (rank + 1) * n]
                    assert torch.equal(block[layer, :r, a_cols], a), (name, layer, module, "A")
                    assert torch.equal(block[layer, :r, b_cols], b.T), (name, layer, module, "B")
        assert not block[:, :, ~seen].any(), "alignment gaps of the shard are not zero"


def test_a_size_that_does_not_split_the_heads_is_refused(tiny_llama):
    with pytest.raises(ModelConfigError, match=r"tensor_parallel_size 3 .*num_attention_heads \(4\)"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=0)


def test_close_leaves_the_group_together_with_the_other_rank(tiny_llama, caplog):
    """Rank 0 starts the group's teardown once rank 1 has said it is in it, so the teardown is graceful
    (not aborted for the time rank 1 took to get there) and rank 1 exits with status 0."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", tensor_parallel_size=2)
    (proc,) = llm.ranks.procs
    llm.generate(PROMPTS[:2], sampling=SAMPLING)
    with caplog.at_level(logging.INFO, logger="lorapipe.tp"):
        llm.close()
    said = [r.getMessage() for r in caplog.records if r.name == "lorapipe.tp"]
    assert any(m.startswith("left the tensor-parallel group in") for m in said), said
    assert proc.returncode == 0


def test_a_rank_that_dies_fails_the_engine_and_leaves_no_process(tiny_llama, llama_adapters):
    llm = LLM(
        tiny_llama,
        device="cpu",
        adapters=llama_adapters,
        dtype="float32",
        max_lora_rank=16,
        tensor_parallel_size=2,
    )
    (proc,) = llm.ranks.procs
    proc.kill()
    proc.wait()
    with pytest.raises(RankFailed, match="tensor-parallel rank 1 exited"):
        llm.generate(PROMPTS[:2], adapters=["full8", None], sampling=SAMPLING)
    llm.close()
    assert proc.poll() is not None


def test_a_failure_on_rank_0_mid_run_stops_every_rank(tiny_llama, llama_adapters, monkeypatch):
    from stages.worker.executor import StepExecutor

    llm = LLM(
        tiny_llama,
        device="cpu",
        adapters=llama_adapters,
        dtype="float32",
        max_lora_rank=16,
        tensor_parallel_size=2,
    )
    (proc,) = llm.ranks.procs
    finish, calls = StepExecutor.finish, []

    def failing_finish(self, step):  # rank 0's second step fails after rank 1 launched the third
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("injected failure on rank 0")
        return finish(self, step)

    monkeypatch.setattr(StepExecutor, "finish", failing_finish)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS[:3], adapters=["full8", None, "qv5"], sampling=SAMPLING)
    assert proc.poll() is not None, "rank 1 outlived rank 0's failure"
    with pytest.raises(RuntimeError, match="engine is closed"):
        llm.generate(PROMPTS[:1], sampling=SAMPLING)
    llm.close()


def test_a_failed_forward_is_not_retried_apart_on_one_rank(tiny_llama, llama_adapters, monkeypatch):
    """One rank alone must not run the batch again adapter by adapter (as one GPU does): the other
    ranks would not join its collectives. The step fails, and the engine stops its ranks."""
    from stages.worker.runner import ModelRunner

    llm = LLM(
        tiny_llama,
        device="cpu",
        adapters=llama_adapters,
        dtype="float32",
        max_lora_rank=16,
        tensor_parallel_size=2,
    )
    (proc,) = llm.ranks.procs
    assert llm.runner.tp is not None
    execute = ModelRunner.execute_grouped

    def failing(self, seqs, *args):  # rank 0's first forward of several adapters fails
        if len({s.slot for s in seqs}) > 1 and not getattr(failing, "done", False):
            failing.done = True
            raise RuntimeError("injected forward failure on rank 0")
        return execute(self, seqs, *args)

    monkeypatch.setattr(ModelRunner, "execute_grouped", failing)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(PROMPTS[:3], adapters=["full8", None, "qv5"], sampling=SAMPLING)
    assert proc.poll() is not None, "rank 1 outlived rank 0's failure"
    llm.close()
