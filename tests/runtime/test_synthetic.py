"""Tests for the tiny-model and LoRA-adapter generators in tools/, checked against transformers and peft."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.synthetic.adapters import main as adapters_main
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import build_config, make_model, parse_overrides, tensor_specs
from runtime.synthetic.model import main as model_main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEXT = "héllo 日本 🙂 The river ran past the mill."


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama"),
        "qwen2": make_model(root / "qwen2", arch="qwen2"),
        # A window shorter than the test prompt so the sliding-window mask is really used.
        "mistral": make_model(root / "mistral", arch="mistral", overrides={"sliding_window": 8}),
    }


def load(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def ids(path: Path) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return torch.tensor([tok(TEXT)["input_ids"]])  # [1, S]


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids).logits  # [1, S, V]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_model_loads_and_gives_finite_logits(models, arch):
    model = load(models[arch])
    cfg = json.loads((models[arch] / "config.json").read_text())
    assert type(model).__name__ == cfg["architectures"][0]
    x = ids(models[arch])
    assert x.shape[1] > 8
    out = logits(model, x)
    assert out.shape == (1, x.shape[1], cfg["vocab_size"])
    assert torch.isfinite(out).all() and out.std() > 1e-3
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch == "qwen2")
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "qwen2")
    if arch == "mistral":
        assert model.config.sliding_window == 8


def test_tiny_llama_rope_scaling_changes_frequencies(models):
    model = load(models["llama"])
    cfg = model.config
    hd = cfg.head_dim
    default = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    inv = model.model.rotary_emb.inv_freq
    assert cfg.rope_parameters["rope_type"] == "llama3"
    # Highest frequency kept, lowest divided by factor, something in between smoothed.
    assert torch.allclose(inv[0], default[0]) and torch.allclose(inv[-1], default[-1] / 8)
    mid = (inv != default) & (~torch.isclose(inv, default / 8))
    assert mid.any()


def test_tokenizer_round_trips_multibyte(models):
    cfg = json.loads((models["llama"] / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(models["llama"])
    enc = tok(TEXT)["input_ids"]
    assert tok.decode(enc) == TEXT
    assert enc[0] != tok.bos_token_id  # documented: no BOS is added automatically
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert 256 < len(tok) <= cfg["vocab_size"]


def test_sharded_loads_identically(models, tmp_path):
    sharded = make_model(tmp_path / "sharded", shard_size_mb=0.1)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / "model.safetensors").exists()
    merged = {k: v for f in files for k, v in load_file(sharded / f).items()}
    whole = load_file(models["llama"] / "model.safetensors")
    assert merged.keys() == whole.keys() and all(torch.equal(merged[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in whole.values())
    a, b = load(sharded), load(models["llama"])
    x = ids(sharded)
    assert torch.equal(logits(a, x), logits(b, x))


def test_bfloat16_is_float32_rounded(models, tmp_path):
    bf = load_file(make_model(tmp_path / "bf16", dtype="bfloat16") / "model.safetensors")
    fp = load_file(models["llama"] / "model.safetensors")
    assert all(bf[k].dtype == torch.bfloat16 and torch.equal(bf[k], fp[k].bfloat16()) for k in fp)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b = make_model(tmp_path / "a", seed=3), make_model(tmp_path / "b", seed=3)
    c = make_model(tmp_path / "c", seed=4)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    ad_a = make_adapters(a, tmp_path / "ad_a", n=2, seed=1)
    ad_b = make_adapters(a, tmp_path / "ad_b", n=2, seed=1)
    ad_c = make_adapters(a, tmp_path / "ad_c", n=2, seed=2)
    for x, y, z in zip(ad_a, ad_b, ad_c, strict=True):
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert (x / f).read_bytes() == (y / f).read_bytes()
        assert (x / "adapter_model.safetensors").read_bytes() != (
            z / "adapter_model.safetensors"
        ).read_bytes()
    w0, w1 = (load_file(p / "adapter_model.safetensors") for p in ad_a)
    assert all(not torch.equal(w0[k], w1[k]) for k in w0)  # adapters differ from each other


@pytest.mark.parametrize(
    "arch,kwargs",
    [
        ("llama", dict(n=2, ranks=(8, 5))),
        ("qwen2", dict(n=2, ranks=(4,), targets=("q_proj", "v_proj"), alpha=16, use_rslora=True)),
    ],
)
def test_adapters_load_in_peft_and_change_logits(models, tmp_path, arch, kwargs):
    paths = make_adapters(models[arch], tmp_path / "adapters", **kwargs)
    x = ids(models[arch])
    outs = []
    for i, path in enumerate(paths):
        conf = json.loads((path / "adapter_config.json").read_text())
        r = kwargs["ranks"][i % len(kwargs["ranks"])]
        assert conf["r"] == r and conf["lora_alpha"] == kwargs.get("alpha", 2 * r)
        base = load(models[arch])
        ref = logits(base, x)
        model = peft.PeftModel.from_pretrained(base, path).eval()
        # Every stored tensor must have landed in the model (a key mismatch would silently keep B = 0).
        stored = load_file(path / "adapter_model.safetensors")
        loaded = peft.get_peft_model_state_dict(model)
        assert stored.keys() == loaded.keys()
        assert all(torch.equal(stored[k], loaded[k]) for k in stored)
        a_key = next(k for k in stored if k.endswith("lora_A.weight"))
        assert stored[a_key].shape[0] == r
        out = logits(model, x)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert torch.isfinite(out).all() and 0.02 < rel < 2.0, rel
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1])


def test_preset_configs_have_documented_shapes():
    b1 = build_config("llama", "1b", dtype="bfloat16")
    assert (b1["hidden_size"], b1["intermediate_size"], b1["num_hidden_layers"]) == (2048, 8192, 16)
    assert (b1["num_attention_heads"], b1["num_key_value_heads"], b1["head_dim"]) == (32, 8, 64)
    assert (b1["vocab_size"], b1["tie_word_embeddings"], b1["rope_theta"]) == (128256, True, 500000.0)
    assert b1["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    b8 = build_config("llama", "8b")
    assert (b8["hidden_size"], b8["intermediate_size"], b8["num_hidden_layers"]) == (4096, 14336, 32)
    assert (b8["num_attention_heads"], b8["num_key_value_heads"], b8["head_dim"]) == (32, 8, 128)
    assert (b8["vocab_size"], b8["tie_word_embeddings"], b8["rope_scaling"]["factor"]) == (128256, False, 8.0)
    # Parameter counts of the real checkpoints.
    assert sum(math.prod(s) for _, s, _ in tensor_specs(b1)) == 1_235_814_400
    assert sum(math.prod(s) for _, s, _ in tensor_specs(b8)) == 8_030_261_248
    for cfg in (b1, b8):
        rope = transformers.LlamaConfig.from_dict(dict(cfg)).rope_parameters
        assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    tiny = build_config("llama")
    assert tiny["intermediate_size"] % 64 != 0 and tiny["num_key_value_heads"] < tiny["num_attention_heads"]


def test_overrides_and_cli(tmp_path):
    assert parse_overrides(["a=8", "b=0.5", "c=true", "d=null", "e=None", "f=silu", 'g={"x": 1}']) == {
        "a": 8, "b": 0.5, "c": True, "d": None, "e": None, "f": "silu", "g": {"x": 1},
    }  # fmt: skip
    cfg = build_config("llama", overrides={"hidden_size": 128, "rope_scaling": None})
    assert cfg["head_dim"] == 32 and cfg["rope_scaling"] is None
    out = tmp_path / "cli"
    model_main([str(out), "--arch", "qwen2", "--no-tie-word-embeddings", "--set", "num_hidden_layers=1"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(out / "model.safetensors")
    adapters_main(
        [str(out), str(tmp_path / "ad"), "--n", "3", "--ranks", "8,16,5", "--targets", "q_proj,v_proj"]
    )
    confs = [
        json.loads((tmp_path / "ad" / f"adapter{i}" / "adapter_config.json").read_text()) for i in range(3)
    ]
    assert [c["r"] for c in confs] == [8, 16, 5] and confs[0]["target_modules"] == ["q_proj", "v_proj"]
