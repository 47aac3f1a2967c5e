"""A plain reference of the sampler's logit adjustments, written token by token over Python lists (no
code shared with stages/worker): vLLM's order, logit bias, repetition penalty over prompt and output,
then frequency and presence penalties over the output; and greedy decoding with them over PEFT logits."""

from __future__ import annotations

from proto.sampling import SamplingParams
from tests.peft_reference import PeftReference


def reference_adjust(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    out = list(row)
    for t, b in (p.logit_bias or {}).items():
        if t < len(out):
            out[t] += b
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen and p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = output.count(t)
        out[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return out


def argmax(row: list[float]) -> int:
    """The first index of the largest value (as torch's argmax)."""
    return max(range(len(row)), key=lambda t: (row[t], -t))


def greedy_adjusted(
    ref: PeftReference, prompt: list[int], n: int, adapter: str | None, p: SamplingParams
) -> list[int]:
    """`n` greedy tokens of transformers + PEFT, each from the logits adjusted as `p` says."""
    output: list[int] = []
    for _ in range(n):
        row = ref.logits(prompt + output, adapter)[-1].double().tolist()
        output.append(argmax(reference_adjust(row, prompt, output, p)))
    return output
