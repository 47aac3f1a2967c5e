"""bench_serving's `--backend openai`: streams each workload request from an OpenAI-compatible server's
/v1/completions over HTTP (httpx), with the same records as the SDK backend. Token ids come from vLLM's
`return_token_ids` extension, which lorapipe serves; counts fall back to the usage chunk."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tools.bench_report import RequestRecord
from tools.workload import WorkloadRequest


async def _sse_lines(r: httpx.Response) -> AsyncIterator[bytes]:
    """SSE lines end at LF only; text lines would also split at U+2028 or U+0085 inside the JSON."""
    buf = b""
    async for data in r.aiter_bytes():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")


class OpenAIBackend:
    """One pooled httpx client for the whole run; `model_for(adapter)` is the adapter's name, or the
    base model's (the entry of GET /v1/models without a parent) for base-only requests."""

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self.base_model = ""

    async def __aenter__(self) -> OpenAIBackend:
        r = await self.http.get(f"{self.base_url}/models")
        r.raise_for_status()
        self.base_model = next(m["id"] for m in r.json()["data"] if m.get("parent") is None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    def body(self, req: WorkloadRequest) -> dict[str, Any]:
        return {
            "model": req.adapter or self.base_model,
            "prompt": req.prompt_value(),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,  # the SDK's default (OpenAI's is 1.0); the workload may override it
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            **req.sampling,
        }

    async def run(self, req: WorkloadRequest, rec: RequestRecord, t0: float, timeout: float) -> None:
        """Stream one request into `rec` (times relative to the send, as the SDK backend's)."""
        rec.start = time.monotonic() - t0
        sent, last, usage_tokens = time.monotonic(), None, None
        try:
            async with self.http.stream("POST", f"{self.base_url}/completions", json=self.body(req)) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
                async for line in _sse_lines(r):
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    now = time.monotonic() - sent
                    rec.request_id = chunk.get("id", rec.request_id)
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"]["completion_tokens"]
                        rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids") or []
                        n = len(ids)
                        if n and rec.ttft is None:
                            rec.ttft = now
                            rec.itl.extend([0.0] * (n - 1))
                        elif n:
                            rec.itl.extend([(now - last) / n] * n)
                        if n:
                            last = now
                        rec.token_ids.extend(ids)
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                            rec.e2e = now
        except Exception as exc:  # a failed request is a result, not a crash of the benchmark
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.output_tokens = len(rec.token_ids) or (usage_tokens or 0)
        rec.end = time.monotonic() - t0
        if rec.error is None and rec.e2e is None:
            rec.error = "stream ended without a finished chunk"
