"""The tokenizer stage's frozen config, composed by the launcher (model limits read from config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints
from runtime.base.sockets import MAX_CLIENT_MSG_BYTES


class TokenizerConfig(StageConfig, frozen=True, kw_only=True):
    model_dir: str  # holds tokenizer.json (and config.json)
    endpoints: Endpoints
    max_model_len: int  # prompt + max_tokens must fit (max_position_embeddings)
    vocab_size: int  # prompt ids and stop ids must be below it
    model_name: str = ""
    adapters: tuple[str, ...] = ()  # names registered at start (--adapter NAME=PATH)
    max_client_msg_bytes: int = MAX_CLIENT_MSG_BYTES  # checked before decoding (zmq drops bigger frames)
    max_prompt_bytes: int = 0  # 0: max_model_len x the longest token's UTF-8 bytes
    # clients must hold it: CURVE + ZAP on the client ROUTER, `Authorization: Bearer KEY` on HTTP /v1/*
    api_key: str | None = None
    adapter_root: str | None = None  # resolved; LoadAdapter paths must lie inside it
    allow_any_adapter_path: bool = False  # without adapter_root: LoadAdapter reads any path (else refused)
    runtime_adapter_loading: bool = True  # False: LoadAdapter/UnloadAdapter are refused
    max_tokenizing_bytes: int = 64 << 20  # text waiting to be tokenized off the loop, all connections
    health_timeout_s: float = 2.0  # a scheduler that does not answer a probe this fast is reported down
    # OpenAI-compatible HTTP front end (stages/tokenizer/http/)
    http_host: str = "127.0.0.1"
    http_port: int = 0  # 0: no HTTP server

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, endpoints: Endpoints, **kw: Any) -> TokenizerConfig:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        kw.setdefault("model_name", Path(model_dir).name)
        return cls(
            model_dir=str(model_dir),
            endpoints=endpoints,
            max_model_len=int(cfg["max_position_embeddings"]),
            vocab_size=int(cfg["vocab_size"]),
            **kw,
        )
