"""The HTTP front end's pure pieces: stop strings over arbitrarily split text (against a plain search of
the whole text), the chat template (against transformers' apply_chat_template on the same files), model
names to adapters, and error kinds to statuses."""

from __future__ import annotations

import random

import pytest

from stages.tokenizer.http.chat_template import ChatTemplate, TemplateError
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.generation import StopText
from stages.tokenizer.http.prepare import Context, resolve_model


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("seed", range(40))
def test_stop_text_equals_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab c\né"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))
    ]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    st, out, stopped = StopText(stops), [], False
    pieces = _split(text, rng)
    for k, piece in enumerate(pieces):
        emitted, stopped = st.feed(piece, final=k == len(pieces) - 1)
        out.append(emitted)
        if stopped:
            break
    assert ("".join(out), stopped) == expected


CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "héllo wörld"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_as_transformers_does(tiny_llama, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ChatTemplate.from_model_dir(tiny_llama).render(messages, add_generation_prompt) == expected


def test_chat_template_errors_name_the_problem(tiny_llama, tmp_path):
    with pytest.raises(TemplateError, match="unknown role tool"):
        ChatTemplate.from_model_dir(tiny_llama).render([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError, match="chat template failed"):
        sandboxed.render([])


def _ctx() -> Context:
    adapters = {"a": "registered", "b": "unloading"}
    return Context(None, "base", 64, 100, adapters, ChatTemplate(None, {}), 256)  # type: ignore[arg-type]


def test_model_names():
    ctx = _ctx()
    assert resolve_model("base", ctx) is None
    assert resolve_model("a", ctx) == "a"
    assert resolve_model("base:a", ctx) == "a"
    assert resolve_model("base:zzz", ctx) == "zzz"  # check_request then reports the unknown adapter
    for name in ("other", "other:a", "zzz"):
        with pytest.raises(ApiError) as info:
            resolve_model(name, ctx)
        assert info.value.status == 404 and info.value.param == "model" and repr(name) in info.value.message


def test_error_kinds_map_to_statuses():
    assert ApiError.of_kind("invalid_request", "x").status == 400
    assert ApiError.of_kind("unknown_adapter", "x").status == 404
    assert ApiError.of_kind("server_error", "the server is shutting down").status == 503
    assert ApiError.of_kind("server_error", "stage 'worker' died").status == 500
    assert b'"param":"top_p"' in ApiError(400, "bad", "top_p").body()
