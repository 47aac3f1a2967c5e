"""The quality half of `bench_fp8.py`: seeded bf16 Llama checkpoints of three weight structures, and the
teacher-forced comparison of engines built on one of them (fp8 base against bf16, and the noise floor
of bf16 against float32), with the relative error of the hidden state after every layer."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.offline import LLM
from runtime.synthetic.model import build_config, tensor_specs, write_tokenizer
from stages.worker.lora.pool import row_bytes
from stages.worker.runner import SeqInput

LOW_RANK = 64
MAX_RANK = 16  # the adapters' rank
# random: every matrix N(0, STD²), STD the config's initializer_range. lowrank: a rank-64 product
# carrying most of each projection, plus full-rank noise. ordered: random, with the projections that
# end a residual branch (o, down) scaled by 1/sqrt(2 layers) as GPT-2 initialises them, and a residual
# stream that starts at unit scale (the embedding N(0, 1)), so that each of the 2 L branches adds a
# small share to the stream instead of remaking it; its lm_head is untied, of STD, so the logits keep
# the random model's scale and do not echo the input token. With pre-norm layers only the ratio of the
# branches to the embedding matters: scaling the branches alone, against an embedding of STD, leaves
# the forward what it was up to scale.
STRUCTURES = ("random", "lowrank", "ordered")
# (reference, compared): the target pair first, then the floor of bf16 against float32 and fp8's own.
PAIRS = (("bf16", "fp8"), ("fp32", "bf16"), ("fp32", "fp8"))


def make_checkpoint(out: Path, cfg: dict, structure: str, device: str, seed: int = 0) -> Path:
    """A bf16 Llama checkpoint of config `cfg`, its tensors drawn on `device`, one file per layer."""
    if structure not in STRUCTURES:
        raise ValueError(f"unknown weight structure {structure!r} (choose from {', '.join(STRUCTURES)})")
    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if structure == "ordered":
        cfg = {**cfg, "tie_word_embeddings": False}
    write_tokenizer(out, cfg["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    std = cfg["initializer_range"]
    branch_end = 1 / math.sqrt(2 * cfg["num_hidden_layers"])
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}  # one layer's tensors (or the others'), written together

    def flush() -> None:
        fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(part, str(out / fname))
        weight_map.update(dict.fromkeys(part, fname))
        part.clear()

    for name, shape, kind in tensor_specs(cfg):
        if kind == "norm":
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
        elif structure == "lowrank" and ".layers." in name and len(shape) == 2:
            u = torch.randn((shape[0], LOW_RANK), generator=gen, device=device)
            v = torch.randn((LOW_RANK, shape[1]), generator=gen, device=device)
            noise = torch.randn(shape, generator=gen, device=device)
            t = std * (0.95 * (u @ v) / math.sqrt(LOW_RANK) + math.sqrt(1 - 0.95**2) * noise)
        else:
            t = std * torch.randn(shape, generator=gen, device=device)
            if structure == "ordered" and (".o_proj." in name or ".down_proj." in name):
                t = t * branch_end
            elif structure == "ordered" and name == "model.embed_tokens.weight":
                t = t / std
        if part and _file_group(name) != _file_group(next(iter(part))):
            flush()
        part[name] = t.to(torch.bfloat16).cpu()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _file_group(name: str) -> str:
    """Which file a tensor goes to: its layer's, or the one of everything outside the layers."""
    return name.split(".")[2] if ".layers." in name else "other"


def model_config(preset: str, shape: dict | None = None) -> dict:
    return build_config("llama", preset, dtype="bfloat16", overrides=shape)


def quality_engine(model: Path, adapters: dict, device: str, kind: str) -> LLM:
    """The least engine that computes the teacher-forced forwards (eagerly, one sequence at a time):
    `kind` fp32 or bf16 (weights and activations in that dtype) or fp8 (bf16 activations, the weights
    quantized at load). Its adapter pool holds every adapter of `adapters` at rank 16 (`load_adapters`)."""
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    layout = LoraLayout.for_model(ModelConfig.from_dir(model), MAX_RANK)
    pool_gb = len(adapters) * MAX_RANK * row_bytes(layout, dtype) / 2**30
    return LLM(model, adapters=adapters, device=device, dtype=str(dtype).removeprefix("torch."),
               quantization="fp8" if kind == "fp8" else None, max_lora_rank=MAX_RANK, max_running_requests=8,
               lora_gpu_memory_gb=pool_gb, num_pages=64, cuda_graph_max_batch=0, cuda_graph_max_tokens=0,
               warmup=False)  # fmt: skip


@torch.inference_mode()
def forward_states(llm: LLM, tokens: list[int], slot: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float32 logits [T, V] of every position of `tokens` (one sequence, adapter pool id `slot`), and
    the hidden states [T, H] (float32) after the embedding and after each layer. The layer loop is
    `LlamaModel.forward`'s, stopped after each layer to read the residual stream."""
    r, m = llm.runner, llm.runner.model
    pages = list(range(-(-len(tokens) // r.cfg.page_size)))
    fb, indptr, slots = r._build_batch([SeqInput(tokens, 0, pages, slot)])
    fb = dataclasses.replace(fb, logits_indices=torch.arange(len(tokens), device=r.device))
    r.lora.prepare(indptr, slots)
    h, cos, sin = m.embed(fb.input_ids, fb.positions)  # [T, H]
    states = [h.float()]
    for i in range(len(m.w.layers)):
        q = m.pre_attention(i, h, fb.kv_rows, r.kv, r.lora, cos, sin)
        attn = m.attend(q, r.kv, i, fb, m.scale, m.cfg.sliding_window)  # [T, heads * D]
        h = m.post_attention(i, h, attn, r.lora)
        states.append(h.float())
    return m.logits(h, fb.logits_indices).float(), states


def load_adapters(engines: dict[str, LLM], names: list[str]) -> None:
    """Adapter i of `names` (of rank MAX_RANK at most) at pool id i, rows MAX_RANK i .., of every engine."""
    for llm in engines.values():
        for slot, name in enumerate(names):
            llm.runner.load_adapter(slot, llm.adapters[name], [(MAX_RANK * slot, llm.adapters[name].rank)])
        if llm.runner.device.type == "cuda":
            torch.cuda.synchronize()


class PairStats:
    """Running sums of one (reference, compared) pair over the positions of many prompts."""

    def __init__(self) -> None:
        self.kl = self.agree = self.positions = 0.0
        self.err2: list[float] = []  # per hidden state: sum of squared differences
        self.ref2: list[float] = []  # and of the reference's squares

    def add(self, ref: tuple[torch.Tensor, list], got: tuple[torch.Tensor, list]) -> None:
        lp_ref, lp_got = torch.log_softmax(ref[0], dim=-1), torch.log_softmax(got[0], dim=-1)
        self.kl += (lp_ref.exp() * (lp_ref - lp_got)).sum(dtype=torch.float64).item()
        self.agree += (lp_ref.argmax(-1) == lp_got.argmax(-1)).sum().item()
        self.positions += lp_ref.shape[0]
        if not self.err2:
            self.err2, self.ref2 = [0.0] * len(ref[1]), [0.0] * len(ref[1])
        for i, (a, b) in enumerate(zip(ref[1], got[1], strict=True)):
            self.err2[i] += (b - a).double().square().sum().item()
            self.ref2[i] += a.double().square().sum().item()

    def result(self) -> dict:
        return {
            "mean_kl": self.kl / self.positions,
            "top1_agreement": self.agree / self.positions,
            "positions": int(self.positions),
            # after the embedding (0) and after each layer: ||h_compared - h_ref|| / ||h_ref||
            "hidden_rel_err": [math.sqrt(e / r) for e, r in zip(self.err2, self.ref2, strict=True)],
        }


def quality(engines: dict[str, LLM], names: list[str], n: int, length: int, vocab: int) -> dict:
    """Teacher-forced over `n` random prompts of `length` tokens, adapter i % len(names) on prompt i:
    for each pair of PAIRS whose engines are given, mean KL(reference || compared) over every position,
    how often their top-1 tokens agree, and the hidden states' relative error layer by layer; and how
    peaked the reference distributions are (the mean top-1 probability of the first engine)."""
    load_adapters(engines, names)
    pairs = [p for p in PAIRS if p[0] in engines and p[1] in engines]
    stats = {p: PairStats() for p in pairs}
    g = torch.Generator().manual_seed(1)
    top_p = 0.0
    for i in range(n):
        tokens = torch.randint(2, vocab, (length,), generator=g).tolist()
        out = {k: forward_states(llm, tokens, i % len(names)) for k, llm in engines.items()}
        for ref, got in pairs:
            stats[ref, got].add(out[ref], out[got])
        top_p += torch.softmax(next(iter(out.values()))[0], dim=-1).amax(-1).sum().item()
        del out
    result = {f"{ref}_{got}": s.result() for (ref, got), s in stats.items()}
    result["ref_top1_prob"] = top_p / (n * length)
    return result
