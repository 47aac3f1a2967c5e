"""Every adapter the runtime cannot serve exactly is refused at load with an `AdapterError` naming the
adapter and the reason, and a refused adapter leaves the engine and its other adapters untouched;
rank_pattern/alpha_pattern, regex targets and exclude_modules are honoured as PEFT honours them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.sampling import SamplingParams
from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_reader import read_adapter
from tests.peft_reference import PeftReference

MAX_RANK = 16
PREFIX = "base_model.model.model.layers"
PROMPTS = ["The river carried the boat past the old mill", "Stories begin"]


@pytest.fixture(scope="module")
def base(tiny_llama) -> tuple[ModelConfig, LoraLayout]:
    m = ModelConfig.from_dir(tiny_llama)
    layout = LoraLayout.build(
        num_layers=m.num_layers,
        hidden=m.hidden_size,
        q_out=m.q_size,
        kv_out=m.kv_size,
        intermediate=m.intermediate_size,
        max_rank=MAX_RANK,
    )
    return m, layout


def read(base, path: Path, name: str = "bad"):
    return read_adapter(name, path, *base, torch.float32)


def refused(base, path: Path, *reasons: str, name: str = "bad") -> str:
    with pytest.raises(AdapterError) as e:
        read(base, path, name)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and e.value.adapter == name
    assert msg.startswith(f"adapter {name!r}: "), msg
    for reason in reasons:
        assert reason in msg, msg
    return msg


def clone(src: Path, tmp_path: Path, config: dict | None = None, add: dict | None = None, drop=()) -> Path:
    """A copy of a good adapter: adapter_config.json updated with `config`, tensors `add`ed and `drop`ped."""
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**c, **config}))
    if add or drop:
        tensors = load_file(dst / "adapter_model.safetensors")
        tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
        save_file(tensors, dst / "adapter_model.safetensors")
    return dst


@pytest.fixture(scope="module")
def full(llama_adapters) -> Path:
    return llama_adapters["full8"]  # rank 8, all seven modules, both layers


def test_good_adapters_are_accepted(base, llama_adapters):
    for name, path in llama_adapters.items():
        assert read(base, path, name).name == name


def test_dora_flag(base, full, tmp_path):
    refused(base, clone(full, tmp_path, {"use_dora": True}), "DoRA", "use_dora")


def test_dora_magnitude_tensor_without_flag(base, full, tmp_path):
    key = f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector"
    refused(base, clone(full, tmp_path, add={key: torch.ones(64)}), "DoRA", key)


def test_dora_saved_by_peft(base, peft_adapters):
    refused(base, peft_adapters["dora"], "DoRA")


def test_modules_to_save(base, full, tmp_path):
    refused(base, clone(full, tmp_path, {"modules_to_save": ["lm_head"]}), "modules_to_save", "lm_head")


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_lm_head_or_embedding_target(base, full, tmp_path, target):
    refused(base, clone(full, tmp_path, {"target_modules": ["q_proj", target]}), f"target {target}")


def test_regex_target_reaching_lm_head(base, full, tmp_path):
    refused(base, clone(full, tmp_path, {"target_modules": r".*\.q_proj|lm_head"}), "lm_head")


def test_lm_head_tensor_not_in_config(base, full, tmp_path):
    key = "base_model.model.lm_head.lora_A.weight"
    refused(base, clone(full, tmp_path, add={key: torch.zeros(8, 64)}), "lm_head targets", key)


def test_embedding_tensor_not_in_config(base, full, tmp_path):
    key = "base_model.model.model.embed_tokens.lora_embedding_A"
    refused(base, clone(full, tmp_path, add={key: torch.zeros(8, 300)}), "embedding targets", key)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_bias(base, full, tmp_path, bias):
    refused(base, clone(full, tmp_path, {"bias": bias}), f"bias={bias!r} is not supported")


def test_lora_b_bias_tensor(base, full, tmp_path):
    key = f"{PREFIX}.0.self_attn.q_proj.lora_B.bias"
    refused(base, clone(full, tmp_path, add={key: torch.zeros(64)}), "bias tensors", key)


def test_rank_above_max_lora_rank(base, tiny_llama, tmp_path):
    (path,) = make_adapters(tiny_llama, tmp_path, n=1, ranks=(32,), targets=("q_proj",), prefix="r32_")
    refused(base, path, "rank 32 exceeds max_lora_rank 16", name="r32")


def _other_model_adapter(tiny_llama, tmp_path, **overrides) -> Path:
    """An adapter generated for a model of another size (make_adapters reads only config.json)."""
    other = tmp_path / "other_model"
    other.mkdir()
    c = json.loads((tiny_llama / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**c, **overrides}))
    (path,) = make_adapters(other, tmp_path, n=1, ranks=(8,), prefix="other")
    return path


def test_adapter_for_wider_model(base, tiny_llama, tmp_path):
    path = _other_model_adapter(tiny_llama, tmp_path, hidden_size=128, intermediate_size=320, head_dim=32)
    down_a = f"{PREFIX}.0.mlp.down_proj.lora_A.weight"
    refused(base, path, down_a, "has shape (8, 320)", "needs (8, 160)", "another model")


def test_adapter_for_deeper_model(base, tiny_llama, tmp_path):
    path = _other_model_adapter(tiny_llama, tmp_path, num_hidden_layers=4)
    refused(base, path, f"{PREFIX}.2.", "is for layer 2, but the base model has 2 layers")


def test_rank_differs_from_config(base, full, tmp_path):
    down_a = f"{PREFIX}.0.mlp.down_proj.lora_A.weight"
    refused(base, clone(full, tmp_path, {"r": 4}), f"{down_a} has rank 8 but adapter_config.json gives r=4")


def test_wrong_shape_of_one_tensor(base, full, tmp_path):
    key = f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"
    path = clone(full, tmp_path, add={key: torch.zeros(40, 8)})
    refused(base, path, key, "has shape (40, 8)", "needs (32, 8)")


def test_missing_lora_b(base, full, tmp_path):
    key = f"{PREFIX}.1.mlp.up_proj.lora_B.weight"
    refused(base, clone(full, tmp_path, drop={key}), f"missing tensor {key}")


def test_missing_module(base, full, tmp_path):
    v_a = f"{PREFIX}.1.self_attn.v_proj.lora_A.weight"
    path = clone(full, tmp_path, drop={v_a, v_a.replace("lora_A", "lora_B")})
    refused(base, path, f"missing tensor {v_a}")


def test_unexpected_tensor(base, full, tmp_path):
    key = f"{PREFIX}.0.self_attn.q_proj.lora_C.weight"
    refused(base, clone(full, tmp_path, add={key: torch.zeros(8, 64)}), f"unexpected tensor {key}")


def test_tensors_for_module_not_in_target_modules(base, llama_adapters, tmp_path):
    k_a = f"{PREFIX}.0.self_attn.k_proj.lora_A.weight"
    k_b = k_a.replace("lora_A", "lora_B")
    # The qv5 adapter targets q_proj and v_proj only.
    path = clone(llama_adapters["qv5"], tmp_path, add={k_a: torch.zeros(5, 64), k_b: torch.zeros(32, 5)})
    refused(base, path, f"extra tensor {k_a}", "does not target")


def test_tensors_for_layer_not_in_layers_to_transform(base, full, tmp_path):
    path = clone(full, tmp_path, {"layers_to_transform": [0]})
    refused(base, path, f"extra tensor {PREFIX}.1.", "layers_to_transform")


def test_bin_pickle(base, full, tmp_path):
    path = clone(full, tmp_path)
    torch.save(load_file(path / "adapter_model.safetensors"), path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    refused(base, path, "adapter_model.bin", "pickle")


def test_truncated_safetensors(base, full, tmp_path):
    path = clone(full, tmp_path)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(base, path, "unreadable adapter_model.safetensors")


def test_garbage_safetensors(base, full, tmp_path):
    path = clone(full, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 16)
    refused(base, path, "unreadable adapter_model.safetensors")


@pytest.mark.parametrize("cut", [True, False], ids=["truncated", "garbage"])
def test_unreadable_adapter_config(base, full, tmp_path, cut):
    path = clone(full, tmp_path)
    text = (path / "adapter_config.json").read_text()
    (path / "adapter_config.json").write_text(text[: len(text) // 2] if cut else "\x00\xff not json")
    refused(base, path, "unreadable adapter_config.json")


def test_missing_directory(base, tmp_path):
    refused(base, tmp_path / "nowhere", "is not a directory")


def test_non_finite_values(base, full, tmp_path):
    q_a = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    nan = torch.zeros(8, 64).index_fill_(1, torch.tensor([3]), float("nan"))
    refused(base, clone(full, tmp_path, add={q_a: nan}), "q_proj of layer 0 holds NaN")


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"lora_bias": True}, "lora_bias"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"use_qalora": True}, "use_qalora"),
        ({"init_lora_weights": "pissa_niter_4"}, "rewrites the base weights"),
        ({"init_lora_weights": "olora"}, "rewrites the base weights"),
        ({"target_modules": ["q_proj", "self_attn"]}, "'self_attn' is not supported"),
    ],
    ids=lambda v: "-".join(map(str, v.items())) if isinstance(v, dict) else "",
)
def test_other_unsupported_options(base, full, tmp_path, option, reason):
    refused(base, clone(full, tmp_path, option), reason)


# ---- adapters saved by PEFT itself -------------------------------------------------------------------


@pytest.fixture(scope="module")
def peft_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft_adapters")
    configs = {
        "dora": dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
        "patterns": dict(
            r=4,
            lora_alpha=8,
            target_modules=list(TARGET_MODULES),
            rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
            alpha_pattern={"v_proj": 3, "layers.0.mlp.gate_proj": 20},
        ),
        "regex_excl": dict(
            r=3, target_modules=r".*\.(q_proj|up_proj)", exclude_modules=["model.layers.0.mlp.up_proj"]
        ),
    }
    out = {}
    for i, (name, kw) in enumerate(configs.items()):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():  # PEFT's random B is large: keep the tiny model's logits in a sane range
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _peft_rank_scaling(model) -> dict[tuple[int, str], tuple[int, float]]:
    from peft.tuners.lora import LoraLayer

    found = {}
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer):
            parts = path.split(".")
            layer, name = int(parts[parts.index("layers") + 1]), parts[-1]
            found[(layer, name)] = (module.r["default"], module.scaling["default"])
    return found


@pytest.mark.parametrize("name", ["patterns", "regex_excl"])
def test_packed_ranks_and_scalings_match_peft(base, tiny_llama, peft_adapters, name):
    ref = PeftReference(tiny_llama, {"default": peft_adapters[name]})
    want = _peft_rank_scaling(ref.model)
    packed = read(base, peft_adapters[name], name)
    for layer in range(base[0].num_layers):
        for sid, module in enumerate(TARGET_MODULES):
            r, scaling = want.get((layer, module), (0, 0.0))
            assert packed.ranks[layer, sid].item() == r, (layer, module)
            assert packed.scalings[layer, sid].item() == pytest.approx(scaling, rel=1e-6), (layer, module)
    assert len(want) == (14 if name == "patterns" else 3)


def test_patterns_and_regex_adapters_generate_like_peft(tiny_llama, peft_adapters, recorded_logits):
    seen = recorded_logits
    adapters = {k: peft_adapters[k] for k in ("patterns", "regex_excl")}
    llm = LLM(tiny_llama, adapters=adapters, max_lora_rank=MAX_RANK, lora_backend="torch")
    names = ["patterns", "regex_excl", "patterns", "regex_excl"]
    outs = llm.generate(PROMPTS * 2, adapters=names, sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    ref = PeftReference(tiny_llama, adapters)
    recorded = [seen[rid] for rid in sorted(seen, key=lambda rid: int(rid[1:]))]  # rids are r0, r1, ...
    for out, name, steps in zip(outs, names, recorded, strict=True):
        ids, start = out.prompt_token_ids + out.token_ids[:-1], len(out.prompt_token_ids) - 1
        want = ref.logits(ids, name)[start:]  # [4, V]
        got = torch.stack(steps)  # [4, V]
        assert ((got - want).norm() / want.norm()).item() < 1e-4, name
        assert out.token_ids == want.argmax(-1).tolist(), name
        base_only = ref.logits(ids, None)[start:]
        assert ((base_only - want).norm() / want.norm()).item() > 1e-2, f"{name} barely moves the logits"


# ---- a refused adapter affects nothing else ----------------------------------------------------------


def test_failed_add_adapter_leaves_the_engine_serving(tiny_llama, llama_adapters, full, tmp_path):
    llm = LLM(tiny_llama, adapters=llama_adapters, max_lora_rank=MAX_RANK, lora_backend="torch")
    names = list(llama_adapters)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(PROMPTS * 2, adapters=names, sampling=sampling)]
    dora = clone(full, tmp_path, {"use_dora": True})
    with pytest.raises(AdapterError, match="adapter 'dora': DoRA"):
        llm.add_adapter("dora", dora)
    with pytest.raises(AdapterError, match="adapter 'full8': DoRA"):
        llm.add_adapter("full8", dora)  # a bad replacement keeps the registered adapter
    assert sorted(llm.adapters) == sorted(names)
    after = [o.token_ids for o in llm.generate(PROMPTS * 2, adapters=names, sampling=sampling)]
    assert after == before


def test_engine_construction_names_the_bad_adapter(tiny_llama, llama_adapters, full, tmp_path):
    bad = clone(full, tmp_path, {"bias": "all"})
    with pytest.raises(AdapterError) as e:
        LLM(tiny_llama, adapters={**llama_adapters, "broken": bad}, max_lora_rank=MAX_RANK)
    assert e.value.adapter == "broken"
    assert str(e.value) == "adapter 'broken': bias='all' is not supported (only 'none')"
