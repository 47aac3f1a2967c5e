"""One rank's shard of the base model (Megatron's split): Q/K/V and gate/up by output rows (attention
heads, intermediate features), O and down by input columns, the embedding and the LM head by vocabulary
rows. A projection split by input columns keeps its bias on rank 0 only, since the ranks' outputs are
summed. An fp8 projection's per-row scales go with its rows (Q/K/V, gate/up) or stay whole (O, down: a
split of input columns leaves every output row). The rank's `ModelConfig` has its own head and feature
counts and the whole vocabulary."""

from __future__ import annotations

import dataclasses

import torch

from runtime.common.model_config import ModelConfig, check_divisible
from stages.worker.model.linear import Fp8Weight, Weight
from stages.worker.model.weights import LayerWeights, ModelWeights


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """What one rank's forward computes: its heads, KV heads and MLP features; the whole vocabulary."""
    check_divisible(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """[first, first + rows) of the vocabulary rows a rank holds; each rank has ceil(vocab / size) rows,
    the last one's padded past the vocabulary with zero rows."""
    rows = -(-vocab // size)
    return rank * rows, rows


def _rows(t: torch.Tensor, first: int, n: int) -> torch.Tensor:
    return t[first : first + n]


def _vocab_rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    first, rows = vocab_range(t.shape[0], rank, size)
    out = t.new_zeros((rows, *t.shape[1:]))
    part = t[first : first + rows]
    out[: part.shape[0]] = part
    return out


def shard_weights(w: ModelWeights, cfg: ModelConfig, rank: int, size: int) -> ModelWeights:
    """Rank `rank`'s shard of whole weights `w` of model `cfg` (new contiguous tensors)."""
    check_divisible(cfg, size)
    q, kv, inter = cfg.q_size // size, cfg.kv_size // size, cfg.intermediate_size // size
    qkv_parts = ((0, q), (cfg.q_size, kv), (cfg.q_size + cfg.kv_size, kv))  # (start in whole, rows)
    gate_up_parts = ((0, inter), (cfg.intermediate_size, inter))

    def by_rows(t: Weight | None, parts) -> Weight | None:
        if t is None:
            return None
        if isinstance(t, Fp8Weight):
            return Fp8Weight(by_rows(t.q, parts), by_rows(t.scale, parts))
        return torch.cat([_rows(t, start + rank * n, n) for start, n in parts]).contiguous()

    def by_cols(t: Weight, n: int) -> Weight:
        if isinstance(t, Fp8Weight):
            return Fp8Weight(by_cols(t.q, n), t.scale)
        return t[:, rank * n : (rank + 1) * n].contiguous()

    def rank0_bias(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or rank == 0 else None

    layers = [
        LayerWeights(
            input_norm=lw.input_norm,
            qkv=by_rows(lw.qkv, qkv_parts),
            qkv_bias=by_rows(lw.qkv_bias, qkv_parts),
            o=by_cols(lw.o, q),
            o_bias=rank0_bias(lw.o_bias),
            post_norm=lw.post_norm,
            gate_up=by_rows(lw.gate_up, gate_up_parts),
            gate_up_bias=by_rows(lw.gate_up_bias, gate_up_parts),
            down=by_cols(lw.down, inter),
            down_bias=rank0_bias(lw.down_bias),
        )
        for lw in w.layers
    ]
    embed = _vocab_rows(w.embed, rank, size)
    lm_head = embed if w.lm_head is w.embed else _vocab_rows(w.lm_head, rank, size)
    return ModelWeights(embed=embed, layers=layers, norm=w.norm, lm_head=lm_head)


def to_device(w: ModelWeights, device: torch.device) -> ModelWeights:
    """`w` on `device`, a tied LM head still the embedding itself."""

    def mv(t: Weight | None) -> Weight | None:  # an Fp8Weight moves its codes and scales
        return None if t is None else t.to(device)

    layers = [
        LayerWeights(**{f.name: mv(getattr(lw, f.name)) for f in dataclasses.fields(lw)}) for lw in w.layers
    ]
    embed = mv(w.embed)
    lm_head = embed if w.lm_head is w.embed else mv(w.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=mv(w.norm), lm_head=lm_head)
