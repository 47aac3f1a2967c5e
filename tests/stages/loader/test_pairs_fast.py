"""The whole-set fast path of the tensor checks (`_fast_pairs`, against the cached `expected` table)
never decides differently from the reference checks (`_group_pairs`): for every config and tensor set
it either declines (the reference then accepts or words the refusal) or returns exactly the reference's
pairs, in order, placed as the reference pairs are. It takes every file holding exactly the targeted
tensors; the cached table answers as the config itself does, per distinct config (pattern order
included)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from stages.loader.adapter_check import _fast_pairs, _group_pairs
from stages.loader.adapter_config import AdapterError, read_adapter_config
from stages.loader.adapter_modules import expected, module_dims, module_path, tensor_key
from stages.loader.placement import place_expected, place_pairs
from stages.loader.safetensors_format import TensorEntry

CONFIGS = {
    "all": {"r": 4, "target_modules": list(TARGET_MODULES)},
    "qv layer 0": {"r": 3, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]},
    "patterns": {
        "r": 4,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["self_attn.q_proj", "k_proj", "down_proj"],
        "rank_pattern": {"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
        "alpha_pattern": {"k_proj": 3},
    },
    "regex": {"r": 2, "target_modules": r".*\.(o_proj|up_proj)"},
    "all-linear": {"r": 5, "target_modules": "all-linear", "exclude_modules": ["gate_proj"]},
}


@pytest.fixture(scope="module")
def cfg(tiny_llama) -> ModelConfig:
    return ModelConfig.from_dir(tiny_llama)


def config(tmp_path: Path, conf: dict):
    d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **conf}))
    return read_adapter_config("x", d)


def valid(cfg: ModelConfig, acfg) -> dict[str, TensorEntry]:
    """The tensors PEFT saves for this config, in file-key order (offsets are not looked at here)."""
    dims, out, pos = module_dims(cfg), {}, 0
    for layer in range(cfg.num_layers):
        for module in TARGET_MODULES:
            if acfg.targets(module_path(layer, module)):
                r, _ = acfg.rank_and_scaling(module_path(layer, module))
                fan_in, fan_out = dims[module]
                for ab, shape in (("A", (r, fan_in)), ("B", (fan_out, r))):
                    key = tensor_key(layer, module, ab)
                    out[key] = TensorEntry(key, "F32", shape, pos, pos + 4 * shape[0] * shape[1])
                    pos = out[key].end
    return dict(sorted(out.items()))


def agree(cfg: ModelConfig, acfg, entries: dict[str, TensorEntry]):
    """(fast answer, reference pairs or its AdapterError), after checking they agree."""
    exp = expected(cfg, acfg)
    fast = _fast_pairs(entries, exp)
    if fast is not None:
        fast = dict(zip(exp.modules, zip(*fast, strict=True), strict=True))
    try:
        ref = _group_pairs("x", entries, cfg, acfg)
    except AdapterError as e:
        ref = e
    if fast is not None:
        assert not isinstance(ref, AdapterError), ref
        assert fast == ref and list(fast) == list(ref)
    return fast, ref


def _rename(entries: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): e._replace(name=new if k == old else k) for k, e in entries.items()}


def mutations(cfg: ModelConfig, good: dict[str, TensorEntry], rng: random.Random):
    keys = list(good)
    k = rng.choice(keys)
    e = good[k]
    yield "drop one", {x: v for x, v in good.items() if x != k}
    yield "wrong rank", {**good, k: e._replace(shape=(e.shape[0] + 1, e.shape[1]))}
    yield "wrong dim", {**good, k: e._replace(shape=(e.shape[1], e.shape[0] + 7))}
    yield "1-D", {**good, k: e._replace(shape=(e.shape[0] * e.shape[1],))}
    yield "int dtype", {**good, k: e._replace(dtype="I32")}
    yield "float64", {**good, k: e._replace(dtype="F64")}
    yield "zero-padded layer", _rename(good, k, k.replace("layers.", "layers.0", 1))
    yield "trailing newline", _rename(good, k, k + "\n")
    yield "past the last layer", _rename(good, k, k.replace("layers.0.", f"layers.{cfg.num_layers}."))
    yield "lm_head", {**good, "base_model.model.lm_head.lora_A.weight": e}
    for module in TARGET_MODULES:  # an untargeted module's pair, or half of it
        a, b = tensor_key(0, module, "A"), tensor_key(0, module, "B")
        if a not in good:
            yield "extra pair", {**good, a: e._replace(name=a), b: e._replace(name=b)}
            yield "extra A", {**good, a: e._replace(name=a)}
    yield "shuffled", dict(rng.sample(list(good.items()), len(good)))
    yield "nothing", {}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_pairs_take_valid_files_and_never_disagree(cfg, tmp_path, name):
    acfg = config(tmp_path, CONFIGS[name])
    good = valid(cfg, acfg)
    fast, ref = agree(cfg, acfg, good)
    assert fast is not None, ref
    exp, layout = expected(cfg, acfg), LoraLayout.for_model(cfg, 8)
    a, b = _fast_pairs(good, exp)
    assert place_expected(a, b, exp, layout) == place_pairs(ref, exp, layout)
    rng = random.Random(name)
    for _ in range(20):
        for what, entries in mutations(cfg, good, rng):
            fast, ref = agree(cfg, acfg, entries)
            if what in ("shuffled", "float64"):
                assert fast is not None, (what, ref)


def test_the_cached_table_follows_pattern_order(cfg, tmp_path):
    """PEFT's first matching pattern key wins, so configs differing only in key order differ."""
    first = {
        "r": 4,
        "target_modules": ["q_proj"],
        "rank_pattern": {"q_proj": 2, "layers.0.self_attn.q_proj": 3},
    }
    second = {**first, "rank_pattern": dict(reversed(first["rank_pattern"].items()))}
    for conf in (first, second, first):
        acfg = config(tmp_path, conf)
        table = expected(cfg, acfg)
        for layer, module in table.modules:
            assert table.rank_scaling[layer, module] == acfg.rank_and_scaling(module_path(layer, module))
    assert expected(cfg, config(tmp_path, first)) is expected(cfg, config(tmp_path, first))
    assert expected(cfg, config(tmp_path, first)) != expected(cfg, config(tmp_path, second))
