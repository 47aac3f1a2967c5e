"""The HTTP app's API-key guard and body limits, on the real app (build_app) with a stand-in front end
that answers /v1/models and /health: the guard and the body checks are what is under test here."""

from __future__ import annotations

from starlette.testclient import TestClient

from stages.tokenizer.http.app import build_app
from stages.tokenizer.http.schemas import ModelCard, ModelList


class Front:
    max_body_bytes = 1024

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    async def model_list(self) -> ModelList:
        return ModelList([ModelCard("base", 0, "/m")])

    async def health(self) -> tuple[bool, dict]:
        return True, {"status": "ok"}


def test_api_key_guards_v1_but_not_health():
    client = TestClient(build_app(Front("s3cret")))
    assert client.get("/v1/models").status_code == 401
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "base"
    assert client.get("/health").status_code == 200
    for path in ("/tokenize", "/detokenize"):  # vLLM's routes, outside /v1, need the key too
        assert client.post(path, json={"prompt": "x"}).status_code == 401
    assert TestClient(build_app(Front(None))).get("/v1/models").status_code == 200


def test_bodies_too_large_or_malformed_are_refused_by_name():
    client = TestClient(build_app(Front(None)))
    big = client.post("/v1/completions", content=b"x" * 2000, headers={"content-type": "application/json"})
    assert big.status_code == 413 and "1024" in big.json()["error"]["message"]
    bad = client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    typed = client.post("/v1/completions", json={"model": "base", "prompt": "x", "n": "two"})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "n"
    missing = client.post("/v1/chat/completions", json={"model": "base"})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
