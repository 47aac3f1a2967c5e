"""The Llama-family forward (Llama, Qwen2, Mistral) over flattened tokens: linear layers (`linear.py`:
torch's, or fp8 GEMMs for fp8 weights), every one's LoRA delta added by the backend handed in (none for
base-only batches), attention and the pointwise ops (norms, rotary + K/V write, activation) from the
backends chosen at construction."""

from __future__ import annotations

import torch

from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, rope_inv_freq
from stages.worker.lora.backend import LoraBackend
from stages.worker.model.attention import attention_fn
from stages.worker.model.forward_batch import ForwardBatch
from stages.worker.model.kv_cache import KVCache
from stages.worker.model.linear import linear
from stages.worker.model.pointwise import pointwise_ops
from stages.worker.model.split import WHOLE
from stages.worker.model.weights import LayerWeights, ModelWeights


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        lora_layout: LoraLayout | None,
        attention_backend: str = "torch",
        pointwise_backend: str = "torch",
    ):
        self.cfg = cfg
        self.w = weights
        self.lora_layout = lora_layout
        self.attention_backend = attention_backend  # "triton" reads each ForwardBatch's attn_plan
        self.attend = attention_fn(attention_backend)
        self.pointwise_backend = pointwise_backend
        self.ops = pointwise_ops(pointwise_backend)  # norms, rotary + K/V write, activation
        device = weights.embed.device
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
        pos = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        dtype = weights.embed.dtype
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.scale = cfg.head_dim**-0.5
        # where the weights are whole (here) or split over ranks (stages/worker/tp/transform.py)
        self.split = WHOLE

    def forward(
        self, fb: ForwardBatch, kv: KVCache, lora: LoraBackend | None, layer_waits: list[list] | None = None
    ) -> torch.Tensor:
        """Returns logits [B, V] (float32) of each sequence's last new token. `layer_waits[i]`: CUDA
        events the compute stream waits on before layer i (that layer's adapter weights being copied).
        The pieces below are what piecewise CUDA graphs capture, attention running between them."""
        h, cos, sin = self.embed(fb.input_ids, fb.positions)
        stream = torch.cuda.current_stream(h.device) if layer_waits else None
        for i in range(len(self.w.layers)):
            if stream is not None:
                for event in layer_waits[i]:
                    stream.wait_event(event)
            q = self.pre_attention(i, h, fb.kv_rows, kv, lora, cos, sin)
            attn = self.attend(q, kv, i, fb, self.scale, self.cfg.sliding_window)  # [T, H * D]
            h = self.post_attention(i, h, attn, lora)
        return self.logits(h, fb.logits_indices)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Hidden states [T, H] and the rotary cos/sin [T, 1, D] of the tokens' positions."""
        h = self.split.lookup(self.w.embed, input_ids)  # [T, H]
        return h, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def pre_attention(self, i: int, h, kv_rows, kv: KVCache, lora, cos, sin) -> torch.Tensor:
        """Layer i up to attention: norm, QKV (+ LoRA), rotary, the K/V write. Returns q [T, heads, D]."""
        cfg, lw = self.cfg, self.w.layers[i]
        x = self.ops.norm(h, lw.input_norm, cfg.rms_norm_eps)
        self._begin(lora, x, i, "qkv")
        qkv = linear(x, lw.qkv, lw.qkv_bias)  # [T, q + 2 kv]
        self._lora(lora, x, qkv, i, "qkv")
        return self.ops.rope_kv(qkv, cos, sin, kv_rows, kv, i, cfg.num_heads, cfg.num_kv_heads)  # [T, H, D]

    def post_attention(self, i: int, h, attn, lora) -> torch.Tensor:
        """Layer i after attention: O (+ LoRA) and the residual, then the MLP block. Returns h [T, H]."""
        lw = self.w.layers[i]
        self._begin(lora, attn, i, "o")
        o = linear(attn, lw.o, lw.o_bias)  # [T, H]
        self._lora(lora, attn, o, i, "o")
        o = self.split.sum_partial(o)
        h, x = self.ops.add_norm(h, o, lw.post_norm, self.cfg.rms_norm_eps)  # h + o and its norm
        return h + self._mlp(i, lw, x, lora)

    def logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        last = self.ops.norm(h[logits_indices], self.w.norm, self.cfg.rms_norm_eps)  # [B, H]
        return self.split.vocab_logits(last, self.w.lm_head)  # [B, V]

    def _begin(self, lora: LoraBackend | None, x, layer: int, group: str) -> None:
        if lora is not None:  # the backend may start the group's shrink beside the projection
            lora.begin(x, layer, self.lora_layout.group(group))

    def _lora(self, lora: LoraBackend | None, x, out, layer: int, group: str) -> None:
        if lora is not None:
            lora.apply(x, out, layer, self.lora_layout.group(group))

    def _mlp(self, i, lw: LayerWeights, x, lora) -> torch.Tensor:
        self._begin(lora, x, i, "gate_up")
        gate_up = linear(x, lw.gate_up, lw.gate_up_bias)  # [T, 2I]
        if lora is None:
            act = self.ops.act(gate_up)  # silu(gate) * up, [T, I]
        else:  # the backend may fuse the delta into the activation
            act = lora.apply_act(x, gate_up, i, self.lora_layout.group("gate_up"), self.ops.act)
        self._begin(lora, act, i, "down")
        down = linear(act, lw.down, lw.down_bias)  # [T, H]
        self._lora(lora, act, down, i, "down")
        return self.split.sum_partial(down)
