"""The OpenAI-compatible HTTP front end, served by the tokenizer stage (`--host`/`--port`)."""

from stages.tokenizer.http.front import HttpFrontEnd

__all__ = ["HttpFrontEnd"]
