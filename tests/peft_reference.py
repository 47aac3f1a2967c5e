"""The independent reference: transformers + PEFT, each request run alone with its own adapter."""

from __future__ import annotations

from pathlib import Path

import torch


class PeftReference:
    def __init__(self, model_dir: Path, adapters: dict[str, Path], dtype=torch.float32):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int], adapter: str | None) -> torch.Tensor:
        """[len(token_ids), V] float32 logits of the whole sequence with `adapter` (None: base only)."""
        ids = torch.tensor([token_ids])
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(input_ids=ids).logits[0].float()
        self.model.set_adapter(adapter)
        return self.model(input_ids=ids).logits[0].float()
