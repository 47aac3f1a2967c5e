"""Structured output requested over HTTP: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `guided_json`, `guided_regex`, `guided_choice` and `structured_outputs` to one `Guided`, checked
here (runtime/common/grammar.py) so a bad schema or regex is a 400 naming the field that carried it."""

from __future__ import annotations

from typing import Any

import msgspec

from proto.sampling import Guided
from runtime.common.grammar import grammar_error
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.strict import unsupported_field

# vLLM's structured_outputs keys this server honours; the others pass only with their neutral value
_STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "json_object": "json_object"}
_STRUCTURED_NEUTRAL = {
    "disable_fallback": (None, False),
    "disable_any_whitespace": (None, False, True),  # output JSON is compact either way
    "disable_additional_properties": (None, False),
    "grammar": (None,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def _json_spec(value: Any, field: str) -> str:
    """A JSON schema given as an object or as its JSON text, to its text."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return msgspec.json.encode(value).decode()
    raise ApiError(400, f"{field} must be a JSON schema (an object)", field)


def _choice_spec(value: Any, field: str) -> str:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ApiError(400, f"{field} must be a list of strings", field)
    return msgspec.json.encode(value).decode()


def _response_format(fmt: dict[str, Any]) -> Guided | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guided("json_object")
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or body.get("schema") is None:
            field = "response_format.json_schema.schema"
            raise ApiError(400, f"{field} is required with type json_schema", "response_format")
        return Guided("json", _json_spec(body["schema"], "response_format"))
    message = f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    raise ApiError(400, message, "response_format")


def _structured_outputs(so: dict[str, Any]) -> Guided | None:
    for key, value in so.items():
        if key not in _STRUCTURED_KINDS and key not in _STRUCTURED_NEUTRAL:
            name = f"structured_outputs.{key}"
            raise ApiError(400, f"unknown field {name!r}", name, "unknown_parameter")
        if key in _STRUCTURED_NEUTRAL and value not in _STRUCTURED_NEUTRAL[key]:
            raise unsupported_field(f"structured_outputs.{key}")
    given = [k for k in _STRUCTURED_KINDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        message = f"structured_outputs takes one of json, regex, choice, json_object, got {given}"
        raise ApiError(400, message, "structured_outputs")
    if not given:
        return None
    key = given[0]
    value = so[key]
    if key == "json":
        return Guided("json", _json_spec(value, "structured_outputs"))
    if key == "choice":
        return Guided("choice", _choice_spec(value, "structured_outputs"))
    if key == "regex":
        if not isinstance(value, str):
            raise ApiError(400, "structured_outputs.regex must be a string", "structured_outputs")
        return Guided("regex", value)
    return Guided("json_object")


def guided_of(req: Any) -> Guided | None:
    """The request's structured output (None: free text), checked: a malformed or unsupported schema, a
    bad regex or empty choices are a 400 naming the field; two fields asking at once are refused."""
    found: list[tuple[str, Guided]] = []
    if req.response_format is not None:
        if (g := _response_format(req.response_format)) is not None:
            found.append(("response_format", g))
    if req.guided_json is not None:
        found.append(("guided_json", Guided("json", _json_spec(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", Guided("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", Guided("choice", _choice_spec(req.guided_choice, "guided_choice"))))
    if req.structured_outputs is not None:
        if (g := _structured_outputs(req.structured_outputs)) is not None:
            found.append(("structured_outputs", g))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"ask for one structured output at a time, got {names}", found[1][0])
    field, guided = found[0]
    if (why := grammar_error(guided)) is not None:
        raise ApiError(400, f"{field}: {why}"[:4000], field)
    return guided
