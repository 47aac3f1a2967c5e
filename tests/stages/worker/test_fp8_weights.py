"""fp8 base weights on the CPU: pre-quantized checkpoints in every layout the worker reads (per-tensor and
per-channel scales) load to exactly the codes and scales in the files; a bf16 checkpoint quantized at load
is within half an e4m3 step of its float64 weights, one scale per output row; the LoRA delta is added in
bf16 to the fp8 GEMM's output, weight-only (few tokens) or with the activations quantized per token; a
checkpoint quantized in a way the worker cannot run is refused at start, with one line naming the format.
(The fp8 GEMM itself on CUDA: test_fp8_linear_gpu.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_gemm import MAX_M
from runtime.common.model_config import ModelConfig, ModelConfigError
from runtime.serve_args import ServeArgsError
from runtime.serve_checks import parse_serve_args
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.fp8 import write_fp8
from runtime.synthetic.model import make_model
from stages.loader.adapter_reader import read_adapter
from stages.worker.model.linear import FP8_MAX, Fp8Weight, cat_weights, linear, quantize_weight
from stages.worker.model.weights import load_weights
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from stages.worker.tp.shard import shard_weights
from tests.conftest import NO_FIXED_PORTS

CPU = torch.device("cpu")
GROUPS = {
    "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "o": ["self_attn.o_proj"],
    "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
    "down": ["mlp.down_proj"],
}


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("fp8w") / "bf16", preset="tiny", dtype="bfloat16", seed=7)


@pytest.mark.parametrize(
    "layout, strategy",
    [("compressed-tensors", "channel"), ("compressed-tensors", "tensor"), ("fbgemm_fp8", "channel"),
     ("fp8", "tensor")],
)  # fmt: skip
def test_prequantized_checkpoint_loads_its_codes_and_scales(bf16_model, tmp_path, layout, strategy):
    fp8 = write_fp8(bf16_model, tmp_path / "fp8", layout, strategy)
    cfg = ModelConfig.from_dir(fp8)
    assert cfg.quantization is not None and cfg.quantization.method == layout
    w = load_weights(fp8, cfg, torch.bfloat16, CPU)
    files = load_file(str(fp8 / "model.safetensors"))
    for i, lw in enumerate(w.layers):
        for group, modules in GROUPS.items():
            got = getattr(lw, group)
            assert isinstance(got, Fp8Weight) and got.q.dtype == torch.float8_e4m3fn
            want = []
            for m in modules:  # float64 codes * scale, straight from the file
                name = f"model.layers.{i}.{m}"
                codes, scale = files[name + ".weight"].double(), files[name + ".weight_scale"].double()
                assert scale.numel() == (codes.shape[0] if strategy == "channel" else 1)
                want.append(codes * (scale.reshape(-1, 1) if scale.numel() > 1 else scale))
            assert torch.equal(got.dequantize(torch.float64), torch.cat(want))
    base = load_weights(bf16_model, ModelConfig.from_dir(bf16_model), torch.bfloat16, CPU)
    assert torch.equal(w.embed, base.embed) and torch.equal(w.lm_head, base.lm_head)  # left as they are


def test_load_time_quantization_per_output_channel(bf16_model):
    cfg = ModelConfig.from_dir(bf16_model)
    w = load_weights(bf16_model, cfg, torch.bfloat16, CPU, quantize=True)
    files = load_file(str(bf16_model / "model.safetensors"))
    for i, lw in enumerate(w.layers):
        for group, modules in GROUPS.items():
            got = getattr(lw, group)
            assert isinstance(got, Fp8Weight)
            ref = torch.cat([files[f"model.layers.{i}.{m}.weight"].double() for m in modules])  # [N, K]
            amax = ref.abs().amax(dim=1)
            assert torch.allclose(got.scale.double(), amax / FP8_MAX, rtol=1e-6, atol=0)  # one per row
            deq = got.dequantize(torch.float64)
            # half an e4m3 step: 2^-4 of the value in the normal range, 2^-10 of the scale below it
            bound = torch.maximum(ref.abs() * 2.0**-4, got.scale.double()[:, None] * 2.0**-10)
            assert ((deq - ref).abs() <= bound * (1 + 1e-6)).all()
            assert torch.allclose(deq.abs().amax(dim=1), amax, rtol=1e-6)  # each row's largest is exact


@pytest.mark.parametrize("tokens", [4, MAX_M + 5])  # the weight-only GEMM, then activations quantized
def test_lora_delta_is_added_in_bf16_to_the_fp8_output(bf16_model, tmp_path, tokens):
    (adapter,) = make_adapters(bf16_model, tmp_path / "adapters", n=1, ranks=(8,), alpha=16, seed=3)
    file = adapter / "adapter_model.safetensors"
    tensors = {k: t * 10 if "lora_B" in k else t for k, t in load_file(str(file)).items()}
    save_file(tensors, str(file))  # a delta as large as the base output, so that its precision shows
    runner = ModelRunner(RunnerConfig(model_dir=str(bf16_model), quantization="fp8", max_lora_rank=8))
    packed = read_adapter("a", adapter, runner.full_cfg, runner.host_layout, runner.dtype, pin_memory=False)
    runner.load_adapter(0, packed, [(0, packed.rank)])
    assert runner.pool.dtype == torch.bfloat16
    seen = []
    apply = runner.lora.apply

    def recording(x, out, layer, group):  # the real backend, its inputs and output kept
        before = out.clone()
        apply(x, out, layer, group)
        seen.append((layer, group.name, x.clone(), before, out.clone()))

    runner.lora.apply = recording
    ids = [2 + (7 * i) % 97 for i in range(tokens)]
    runner.execute([SeqInput(ids, 0, list(range(-(-tokens // runner.cfg.page_size))), 0)])
    layer, name, x, before, after = next(s for s in seen if s[:2] == (0, "qkv"))
    assert x.dtype == before.dtype == after.dtype == torch.bfloat16
    qkv = runner.model.w.layers[0].qkv
    assert isinstance(qkv, Fp8Weight)
    x64 = x.double()
    x_deq = x64  # up to MAX_M tokens the GEMM takes the input as it is
    if tokens > MAX_M:
        xs = x64.abs().amax(dim=1, keepdim=True) / FP8_MAX  # the GEMM's per-token input scale
        x_deq = (x64 / xs).float().to(torch.float8_e4m3fn).double() * xs
    gemm = x_deq @ qkv.dequantize().t()
    assert ((before.double() - gemm).norm() / gemm.norm()).item() < 4e-3  # bf16 rounding of the output
    scaling = json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"] / 8
    deltas = []
    for m in GROUPS["qkv"]:
        key = f"base_model.model.model.layers.0.{m}"
        a, b = tensors[key + ".lora_A.weight"].double(), tensors[key + ".lora_B.weight"].double()
        deltas.append(x64 @ a.t() @ b.t() * scaling)
    delta = torch.cat(deltas, dim=1)  # [T, q + 2 kv], float64 from the adapter's own weights
    assert delta.norm() > 0.5 * gemm.norm()  # large enough that an fp8 delta would show
    # the sum rounded once to bf16 (an fp8 delta would be off by up to 2^-4 of itself)
    err = ((after.double() - (before.double() + delta)).norm() / delta.norm()).item()
    assert err < 8e-3


@pytest.mark.parametrize(
    "quant, named",
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size [128, 128]"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "'block'-strategy"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "'int-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {"group_1": {
            "format": "pack-quantized", "weights": {"num_bits": 4, "type": "int"}}}}, "'pack-quantized'"),
        ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}}, "quantized KV cache"),
    ],
)  # fmt: skip
def test_unsupported_quantization_is_refused_by_name(bf16_model, tmp_path, quant, named):
    model = tmp_path / "m"
    shutil.copytree(bf16_model, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ModelConfigError, match="checkpoint quantization .* is not supported") as e:
        ModelConfig.from_dir(model)
    assert named in str(e.value)
    with pytest.raises(ServeArgsError) as e:
        parse_serve_args(["--model", str(model), "--device", "cpu", *NO_FIXED_PORTS])
    assert named in str(e.value) and "\n" not in str(e.value)


def test_unknown_quantization_flag_is_refused(bf16_model):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        ModelRunner(RunnerConfig(model_dir=str(bf16_model), quantization="int4"))


def test_tensor_parallel_shards_the_scales_with_the_weights(bf16_model):
    cfg = ModelConfig.from_dir(bf16_model)
    whole = load_weights(bf16_model, cfg, torch.bfloat16, CPU, quantize=True)
    size = 2
    shards = [shard_weights(whole, cfg, rank, size) for rank in range(size)]
    lw = whole.layers[0]
    for group in ("qkv", "gate_up"):  # by output rows: each rank's rows keep their own scales
        parts = [getattr(s.layers[0], group) for s in shards]
        assert all(isinstance(p, Fp8Weight) for p in parts)
        got = sorted(tuple(r.tolist()) for p in parts for r in p.dequantize())
        assert got == sorted(tuple(r.tolist()) for r in getattr(lw, group).dequantize())
    for group in ("o", "down"):  # by input columns: every output row's scale on every rank
        parts = [getattr(s.layers[0], group) for s in shards]
        assert all(torch.equal(p.scale, getattr(lw, group).scale) for p in parts)
        joined = torch.cat([p.dequantize() for p in parts], dim=1)
        assert torch.equal(joined, getattr(lw, group).dequantize())


def test_a_fused_projection_of_fp8_and_unquantized_parts():
    """A checkpoint that left one of q/k/v unquantized: without --quantization the group runs in the
    activations' dtype (the fp8 parts dequantized); with it, every part is fp8 with its own scales."""
    gen = torch.Generator().manual_seed(0)
    q8 = quantize_weight(torch.randn((32, 16), generator=gen).bfloat16())
    kv = torch.randn((16, 16), generator=gen).bfloat16()
    mixed = cat_weights([q8, kv], quantize=False)
    assert mixed.dtype == torch.bfloat16
    assert torch.equal(mixed, torch.cat([q8.dequantize(torch.float64).bfloat16(), kv]))
    fused = cat_weights([q8, kv], quantize=True)
    assert isinstance(fused, Fp8Weight) and fused.shape == (48, 16)
    assert torch.equal(fused.q[:32].float(), q8.q.float()) and torch.equal(fused.scale[:32], q8.scale)
    kv8 = quantize_weight(kv)
    assert torch.equal(fused.q[32:].float(), kv8.q.float()) and torch.equal(fused.scale[32:], kv8.scale)


def test_group_formats_and_zero_points(bf16_model, tmp_path):
    """compressed-tensors may give the format per config group and store symmetric zero points (zeros):
    both load; a non-zero zero point (an asymmetric scheme) is refused by name."""
    fp8 = write_fp8(bf16_model, tmp_path / "fp8", "compressed-tensors", "channel")
    cfg = json.loads((fp8 / "config.json").read_text())
    quant = cfg["quantization_config"]
    quant["config_groups"]["group_0"]["format"] = quant.pop("format")
    (fp8 / "config.json").write_text(json.dumps(cfg))
    file = fp8 / "model.safetensors"
    tensors = load_file(str(file))
    zeros = {k.replace(".weight_scale", ".weight_zero_point"): torch.zeros_like(v) for k, v in tensors.items()
             if k.endswith(".weight_scale")}  # fmt: skip
    save_file({**tensors, **zeros}, str(file))
    w = load_weights(fp8, ModelConfig.from_dir(fp8), torch.bfloat16, CPU)
    assert isinstance(w.layers[1].down, Fp8Weight)
    name = "model.layers.1.mlp.down_proj.weight_zero_point"
    save_file({**tensors, **zeros, name: torch.ones_like(zeros[name])}, str(file))
    with pytest.raises(ModelConfigError, match=f"{name} is not zero"):
        load_weights(fp8, ModelConfig.from_dir(fp8), torch.bfloat16, CPU)


@pytest.mark.parametrize("tokens", [1, MAX_M, MAX_M + 1])
def test_fp8_linear_quantizes_activations_only_past_max_m(tokens):
    """Up to MAX_M tokens the fp8 GEMM takes the input as it is (weight-only), beyond it each token's
    input rounded to e4m3 with its own scale; the bias is added before the one rounding either way."""
    gen = torch.Generator().manual_seed(tokens)
    w8 = quantize_weight(torch.randn((48, 96), generator=gen).bfloat16())
    x = torch.randn((tokens, 96), generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    x64 = x.double()
    if tokens > MAX_M:
        xs = x64.abs().amax(dim=1, keepdim=True) / FP8_MAX
        x64 = (x64 / xs).float().to(torch.float8_e4m3fn).double() * xs
    want = x64 @ w8.dequantize().t() + bias.double()
    got = linear(x, w8, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 48)
    rel = (got.double() - want).norm() / want.norm()
    assert rel < (4e-3 if tokens <= MAX_M else 6e-3)  # bf16 rounding (of the product, then of the sum)
