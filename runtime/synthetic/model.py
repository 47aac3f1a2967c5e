"""Write a Hugging Face-layout checkpoint (config, seeded random safetensors, byte-level BPE tokenizer).

Tensors are generated and streamed to disk one at a time, so even the 8b preset never sits in memory whole.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_VOCAB = 320  # 2 specials + 256 byte alphabet + merges learned from CORPUS
TINY_VOCAB = 384  # TOKENIZER_VOCAB rounded up to 64, leaving rows no token ever hits (like real checkpoints)
CHUNK = 1 << 22  # elements per float32 scratch fill; bounds temporary memory for the huge tensors

CORPUS = """\
The river ran slowly past the old mill, and the miller's children watched the water turn the wheel.
Every morning they carried bread, cheese and apples down to the bank, where the boats waited for the tide.
Their grandmother told them stories about the winter when the river froze and the town walked across it.

A serving system answers many requests at once. It keeps one copy of the base model in memory and adds a
small low-rank update for each adapter, so thousands of users can share the same weights. The scheduler
decides which requests run in the next step, the worker turns that plan into tensors, and the sampler
picks the next token for every sequence in the batch.

Numbers, dates and prices appear in ordinary text too: 3 apples cost $1.25 on 2024-05-17, and the train
leaves at 09:45 from platform 12. Questions such as "where is the station?" or "what time is it?" are
common, and so are lists: red, green, blue; one, two, three; north, south, east and west.
"""

_ROPE_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
PRESETS: dict[str, dict[str, Any]] = {
    # intermediate 160 is deliberately not a multiple of 64 so kernels see ragged tiles.
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                 rope_theta=10000.0, rms_norm_eps=1e-5),
    # Llama-3.2-1B shapes.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_scaling={**_ROPE_LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}),
    # Llama-3.1-8B shapes.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_scaling={**_ROPE_LLAMA3, "factor": 8.0, "original_max_position_embeddings": 8192}),
}  # fmt: skip
# Tiny llama gets llama3 scaling with a 64-token original context: with head_dim 16 and theta 1e4 the
# wavelengths span all three regimes (kept, smoothed, divided by factor), so tests exercise each one.
TINY_ARCH = {
    "llama": {"tie_word_embeddings": False,
              "rope_scaling": {**_ROPE_LLAMA3, "factor": 8.0, "original_max_position_embeddings": 64}},
    "qwen2": {"tie_word_embeddings": True, "rope_scaling": None},
    "mistral": {"tie_word_embeddings": False, "rope_scaling": None},
}  # fmt: skip


def build_config(
    arch: str = "llama",
    preset: str = "tiny",
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the config.json dict for arch/preset; bos/eos ids are those of the generated tokenizer."""
    if arch not in ARCHS or preset not in PRESETS or dtype not in DTYPES:
        raise ValueError(f"unknown arch/preset/dtype: {arch}/{preset}/{dtype}")
    cfg: dict[str, Any] = {"architectures": [ARCHS[arch]], "model_type": arch, "hidden_act": "silu"}
    cfg.update({"rope_scaling": None, "tie_word_embeddings": False, "initializer_range": 0.02})
    cfg.update(PRESETS[preset])
    if preset == "tiny":
        cfg.update(TINY_ARCH[arch])
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(bos_token_id=0, eos_token_id=1, attention_dropout=0.0, use_cache=True)
    cfg.update(torch_dtype=dtype, dtype=dtype)  # older readers want torch_dtype, transformers 5 dtype
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    else:
        cfg["sliding_window"] = None
    if tie_word_embeddings is not None:
        cfg["tie_word_embeddings"] = tie_word_embeddings
    overrides = dict(overrides or {})
    cfg.update(overrides)
    if "head_dim" not in overrides and {"hidden_size", "num_attention_heads"} & overrides.keys():
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) for every stored tensor, in file order, with the names transformers uses."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias, mlp_bias = cfg.get("attention_bias", False), cfg.get("mlp_bias", False)
    specs = [("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        linears = [
            (f"{p}.self_attn.q_proj", (q_out, h), qkv_bias),
            (f"{p}.self_attn.k_proj", (kv_out, h), qkv_bias),
            (f"{p}.self_attn.v_proj", (kv_out, h), qkv_bias),
            (f"{p}.self_attn.o_proj", (h, q_out), o_bias),
            (f"{p}.mlp.gate_proj", (inter, h), mlp_bias),
            (f"{p}.mlp.up_proj", (inter, h), mlp_bias),
            (f"{p}.mlp.down_proj", (h, inter), mlp_bias),
        ]
        specs.append((f"{p}.input_layernorm.weight", (h,), "norm"))
        for name, shape, bias in linears:
            specs.append((f"{name}.weight", shape, "normal"))
            if bias:
                specs.append((f"{name}.bias", shape[:1], "bias"))
        specs.append((f"{p}.post_attention_layernorm.weight", (h,), "norm"))
    specs.append(("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (cfg["vocab_size"], h), "normal"))
    return specs


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """One generator per tensor, keyed by name, so values do not depend on order or shard layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, mean: float, std: float, g: torch.Generator):
    """Fill in float32 chunks then cast: half-precision normal_ is slower and chunking caps scratch memory."""
    out = torch.empty(math.prod(shape), dtype=dtype)
    scratch = torch.empty(min(CHUNK, out.numel()), dtype=torch.float32)
    for a in range(0, out.numel(), CHUNK):
        n = min(CHUNK, out.numel() - a)
        out[a : a + n].copy_(scratch[:n].normal_(mean, std, generator=g))
    return out.view(*shape)


def _init_tensor(name: str, shape: tuple[int, ...], kind: str, cfg: dict, dtype: torch.dtype, seed: int):
    std = cfg.get("initializer_range", 0.02)
    mean, std = {"normal": (0.0, std), "norm": (1.0, 0.05), "bias": (0.0, std)}[kind]
    return random_tensor(shape, dtype, mean, std, seeded_generator(seed, name))


def _plan_shards(sizes: list[int], shard_bytes: int | None) -> list[list[int]]:
    """Greedy packing in file order; a tensor larger than a shard gets a shard of its own."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shard_bytes is not None and shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype, tensors: Iterator):
    """Stream tensors into a safetensors file: the header is known from shapes before any data exists."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        header[name] = {
            "dtype": ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, shape), t in zip(specs, tensors, strict=True):
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, name
            f.write(_raw_bytes(t))


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes without numpy (not a runtime dependency); little-endian hosts only."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def train_tokenizer():
    """Byte-level BPE: the full byte alphabet is seeded, so any UTF-8 text round-trips. No BOS is added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS],  # ids 0 and 1, matching bos/eos_token_id in build_config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n"), trainer=trainer)
    return tok


# A small chat template in Hugging Face's Jinja dialect (role tags, BOS once, EOS after each turn), so the
# OpenAI chat endpoint and transformers' apply_chat_template can be compared on the same files.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(out: Path, max_len: int) -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the tokenizer's vocab size."""
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    return tok.get_vocab_size()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    shard_size_mb: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint directory into out_dir and return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(
        arch, preset, dtype=dtype, tie_word_embeddings=tie_word_embeddings, overrides=overrides
    )
    n_tok = write_tokenizer(out, cfg["max_position_embeddings"])
    if cfg["vocab_size"] < n_tok:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer size {n_tok}")
    _write_json(out / "config.json", cfg)
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    _write_json(out / "generation_config.json", gen_cfg)

    tdtype = DTYPES[dtype]
    specs = tensor_specs(cfg)
    itemsize = torch.empty((), dtype=tdtype).element_size()
    sizes = [math.prod(shape) * itemsize for _, shape, _ in specs]
    shard_bytes = None if shard_size_mb is None else max(1, int(shard_size_mb * 2**20))
    shards = _plan_shards(sizes, shard_bytes)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a rerun with other sharding must not leave old files behind
    weight_map, nsh = {}, len(shards)
    for k, idx in enumerate(shards):
        fname = "model.safetensors" if nsh == 1 else f"model-{k + 1:05d}-of-{nsh:05d}.safetensors"
        part = [specs[i] for i in idx]
        tensors = (_init_tensor(name, shape, kind, cfg, tdtype, seed) for name, shape, kind in part)
        write_safetensors(out / fname, [(n, s) for n, s, _ in part], tdtype, tensors)
        weight_map.update({name: fname for name, _, _ in part})
    if nsh > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    return out


def parse_value(text: str) -> Any:
    """JSON first (ints, floats, true/false/null, objects); Python spellings and bare strings as fallback."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--shard-size-mb", type=float, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    out = make_model(
        args.out_dir,
        arch=args.arch,
        preset=args.preset,
        dtype=args.dtype,
        seed=args.seed,
        tie_word_embeddings=args.tie_word_embeddings,
        shard_size_mb=args.shard_size_mb,
        overrides=parse_overrides(args.overrides),
    )
    cfg = json.loads((out / "config.json").read_text())
    n_params = sum(math.prod(shape) for _, shape, _ in tensor_specs(cfg))
    n_files = len(list(out.glob("*.safetensors")))
    print(f"{'dir':<40} {'arch':<20} {'params':>15} {'dtype':<9} {'files':>5}")
    print(f"{str(out):<40} {cfg['architectures'][0]:<20} {n_params:>15,} {args.dtype:<9} {n_files:>5}")


if __name__ == "__main__":
    main()
