"""The model's chat template (tokenizer_config.json `chat_template`, or chat_template.jinja/.json beside
it) rendered with Jinja2 the way Hugging Face's `apply_chat_template` does: a sandboxed environment with
trimmed blocks, `raise_exception`, `tojson`, `strftime_now`, and the tokenizer's special tokens."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """The template is missing, or rendering failed (the message says why: a template's own
    raise_exception text, or the Jinja error)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def find_template(config: dict[str, Any], model_dir: Path) -> str | None:
    """The default chat template, wherever this checkpoint keeps it (None: it has none)."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if isinstance(tpl, str):
        return tpl
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        found = json.loads(json_file.read_text()).get("chat_template")
        return found if isinstance(found, str) else None
    return None


class ChatTemplate:
    def __init__(self, source: str | None, special_tokens: dict[str, str | None]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template: jinja2.Template | None = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        path = Path(model_dir)
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        return cls(find_template(config, path), special)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TemplateError(
                "the model has no chat template (tokenizer_config.json has no chat_template); "
                "use /v1/completions"
            )
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **{k: v for k, v in self.special_tokens.items() if v is not None},
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from None
