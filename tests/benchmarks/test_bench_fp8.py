"""bench_fp8's quality half on the CPU: its teacher-forced logits are transformers + PEFT's at every
position of a multi-page prompt with an adapter, two engines of one kind agree exactly (no state shared
or misaligned between the engines of one comparison), the ordered structure is what it says, and a
quality-only run writes every pair's numbers for every layer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from benchmarks import bench_fp8
from benchmarks.fp8_quality import (
    forward_states,
    load_adapters,
    make_checkpoint,
    model_config,
    quality,
    quality_engine,
)
from runtime.synthetic.adapters import make_adapters
from tests.peft_reference import PeftReference

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8q")
    model = make_checkpoint(root / "ordered", model_config("tiny"), "ordered", "cpu")
    paths = make_adapters(model, root / "adapters", n=2, ranks=(16,), dtype="bfloat16", seed=0)
    return model, {p.name: p for p in paths}


def test_teacher_forced_logits_are_peft_s(checkpoint):
    model, adapters = checkpoint
    llm = quality_engine(model, adapters, "cpu", "fp32")
    names = list(adapters)
    load_adapters({"fp32": llm}, names)
    ref = PeftReference(model, adapters)
    tokens = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()  # 3 pages
    for slot, name in enumerate(names):
        logits, states = forward_states(llm, tokens, slot)
        want = ref.logits(tokens, name)
        assert logits.shape == want.shape
        assert ((logits - want).norm() / want.norm()).item() < 1e-4, name
        assert len(states) == 1 + llm.runner.model_cfg.num_layers
    assert (logits - ref.logits(tokens, None)).abs().max() > 1e-3  # the adapter is in the logits


def test_engines_of_one_kind_agree_exactly(checkpoint):
    model, adapters = checkpoint
    # the second engine stands in the slot of the pair's compared engine
    engines = {k: quality_engine(model, adapters, "cpu", "bf16") for k in ("fp32", "bf16")}
    q = quality(engines, list(adapters), 3, 24, 320)["fp32_bf16"]
    assert q["mean_kl"] == 0.0 and q["top1_agreement"] == 1.0 and q["positions"] == 72
    assert q["hidden_rel_err"] == [0.0] * 3


def test_ordered_structure(tmp_path):
    """Branch ends scaled by 1/sqrt(2 layers), a unit-scale embedding, an untied lm_head of the
    initializer_range, every other matrix of it."""
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)  # fmt: skip
    cfg = model_config("1b", shape)  # tied embeddings
    model = make_checkpoint(tmp_path / "m", cfg, "ordered", "cpu")
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is False
    stds = {}
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            stds.update({k: h.get_tensor(k).float().std().item() for k in h.keys() if "norm" not in k})
    assert len(stds) == 2 + 7 * 2  # embedding, lm_head, 7 projections a layer
    std = cfg["initializer_range"]
    branch_end = std / math.sqrt(2 * cfg["num_hidden_layers"])
    for name, got in stds.items():
        if name == "model.embed_tokens.weight":
            want = 1.0
        else:
            want = branch_end if ("o_proj" in name or "down_proj" in name) else std
        assert got == pytest.approx(want, rel=0.1), name


def test_quality_only_run(tmp_path, capsys):
    shape = json.dumps({"num_hidden_layers": 2})
    bench_fp8.main([str(tmp_path / "out"), "--preset", "tiny", "--device", "cpu", "--quality-only",
                    "--quality", "2", "20", "--scratch", str(tmp_path / "s"), "--shape", shape,
                    "--structures", "random", "ordered"])  # fmt: skip
    r = json.loads((tmp_path / "out" / "fp8_bench.json").read_text())
    assert "gemm_us" not in r and "decode_b16" not in r
    for structure in ("random", "ordered"):
        q = r[f"quality_{structure}"]
        assert set(q) == {"bf16_fp8", "fp32_bf16", "fp32_fp8", "ref_top1_prob"}
        for pair in ("bf16_fp8", "fp32_bf16", "fp32_fp8"):
            assert q[pair]["positions"] == 40 and len(q[pair]["hidden_rel_err"]) == 3
            assert 0 < q[pair]["mean_kl"] and 0 < q[pair]["hidden_rel_err"][-1] < 1
    # fp8's weights and activations carry 3 mantissa bits against bf16's 8; in the ordered structure
    # the branches are small against the stream, which all engines but float32's round to bf16 alike
    rand = r["quality_random"]
    assert rand["bf16_fp8"]["hidden_rel_err"][-1] > 4 * rand["fp32_bf16"]["hidden_rel_err"][-1]
    assert "ordered" in capsys.readouterr().out
    assert not list((tmp_path / "s").glob("*-random"))  # removed once read
