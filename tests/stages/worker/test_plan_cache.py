"""The warm-up plan kept beside the compile cache: read back equal to the computed one, under a name that
changes with every input the plan is computed from (so another configuration or an edited heuristic
never reads it), and computed again when the file is unreadable."""

from __future__ import annotations

import torch

from kernels import device_info
from runtime.common.lora_layout import LoraLayout
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.plan_cache import cached_plan, fingerprint
from stages.worker.warmup_plan import attention_variants, lora_launches

ATTN = dict(
    num_heads=8, num_kv_heads=2, max_tokens=64, max_seqs=8, max_model_len=256, device=torch.device("cpu")
)


def _backend(max_tokens: int = 64, max_rank: int = 24, slots: int = 3) -> TritonLoraBackend:
    layout = LoraLayout.build(
        num_layers=1, hidden=256, q_out=256, kv_out=64, intermediate=512, max_rank=max_rank
    )
    return TritonLoraBackend(
        LoraPool(layout, max_rank * slots, slots, torch.float32, torch.device("cpu")), max_tokens
    )


def _plan(backend, padded):
    return lambda: (lora_launches(backend, padded), attention_variants(**ATTN))


def _flat(plan):
    lora, attn = plan
    return [(x.group, x.num_tokens, x.num_tiles, x.block_m, x.block_rank) for x in lora], attn


def test_a_kept_plan_is_read_back_equal(tmp_path, monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    backend, padded = _backend(), (1, 2, 4, (32, 16))
    key = fingerprint(backend, padded, ATTN)
    first, read = cached_plan(str(tmp_path), key, _plan(backend, padded))
    assert not read and first[0] and first[1]
    calls = []
    second, read = cached_plan(str(tmp_path), key, lambda: calls.append(1))
    assert read and not calls
    assert _flat(second) == _flat(first)
    assert [len(set(map(str, x.key))) for x in second[0]] == [len(set(map(str, x.key))) for x in first[0]]


def test_every_input_changes_the_name(monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    base = fingerprint(_backend(), (1, 2), ATTN)
    assert fingerprint(_backend(), (1, 2), ATTN) == base
    others = [
        fingerprint(_backend(max_tokens=128), (1, 2), ATTN),
        fingerprint(_backend(max_rank=40), (1, 2), ATTN),
        fingerprint(_backend(slots=4), (1, 2), ATTN),
        fingerprint(_backend(), (1, 2, 4), ATTN),
        fingerprint(_backend(), (1, 2), {**ATTN, "max_model_len": 512}),
        fingerprint(None, (1, 2), ATTN),
    ]
    monkeypatch.setattr(device_info, "num_sms", lambda device: 78)
    others.append(fingerprint(_backend(), (1, 2), ATTN))
    assert len({base, *others}) == len(others) + 1


def test_an_edited_heuristic_changes_the_name(monkeypatch):
    from stages.worker import plan_cache

    base = fingerprint(None, (1,), ATTN)
    monkeypatch.setattr(plan_cache, "sources_digest", lambda: "edited")
    assert fingerprint(None, (1,), ATTN) != base


def test_an_unreadable_plan_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    backend = _backend()
    key = fingerprint(backend, (), ATTN)
    (tmp_path / f"lorapipe-warmup-plan-{key}.json").write_text('{"lora": [[1, 2]]')  # cut short
    plan, read = cached_plan(str(tmp_path), key, _plan(backend, ()))
    assert not read and plan[0]
    again, read = cached_plan(str(tmp_path), key, lambda: None)
    assert read and _flat(again) == _flat(plan)
