"""Incremental detokenization equals the full decode, and never emits half a character."""

from __future__ import annotations

import pytest

from stages.tokenizer.detokenizer import REPLACEMENT, IncrementalDetokenizer

SAMPLES = ["日本語のテキスト 😀🎉 ok", "héllo wörld naïve", "plain ascii text", "🎉😀日本"]


def _stream(tokenizer, prompt_ids, output_ids, step=1):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.step(output_ids[i : i + step]) for i in range(0, len(output_ids), step)]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_really_are_split_across_tokens(tokenizer):
    ids = tokenizer.encode("😀🎉日本語", add_special_tokens=False).ids
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("prompt", ["", "the prompt: ", "日本"])
def test_incremental_equals_full_decode(tokenizer, text, step, prompt):
    prompt_ids = tokenizer.encode(prompt).ids  # with <s>
    output = tokenizer.encode(text, add_special_tokens=False).ids
    deltas = _stream(tokenizer, prompt_ids, output, step)
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_output_cut_mid_character_is_flushed_like_the_full_decode(tokenizer):
    output = tokenizer.encode("ok 😀", add_special_tokens=False).ids[:-1]
    assert tokenizer.decode(output).endswith(REPLACEMENT)
    deltas = _stream(tokenizer, [], output)
    assert REPLACEMENT not in "".join(deltas[:-1])  # held back while streaming, shown at the end
    assert "".join(deltas) == tokenizer.decode(output)


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.token_to_id("</s>")
    output = [*tokenizer.encode("héllo", add_special_tokens=False).ids, eos]
    assert "".join(_stream(tokenizer, [], output)) == "héllo"


def test_window_stays_small(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x " * 30).ids)
    for i in tokenizer.encode("the quick brown fox " * 20, add_special_tokens=False).ids:
        detok.step([i])
    assert len(detok.ids) < 16
