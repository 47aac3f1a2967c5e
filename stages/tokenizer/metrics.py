"""The tokenizer stage's own series: requests by final outcome and in flight, prompt lengths, tokens
streamed, and the server-side time to first and last token."""

from __future__ import annotations

from collections.abc import Callable

from runtime.base.metrics import StageMetrics


class TokenizerMetrics:
    def __init__(self, m: StageMetrics, in_flight: Callable[[], int]) -> None:
        self.requests = m.counter(
            "lorapipe_requests", "Requests by final outcome, each counted once when it ends", ["outcome"]
        )
        m.gauge("lorapipe_requests_in_flight", "Requests between accept and finish").set_function(in_flight)
        self.prompt = m.histogram("lorapipe_prompt_tokens", "Prompt length", (), [2**i for i in range(4, 17)])
        self.output = m.counter("lorapipe_output_tokens", "Tokens streamed to clients")
        self.ttft = m.histogram("lorapipe_ttft_seconds", "Accept to first output token (server side)")
        self.e2e = m.histogram("lorapipe_e2e_seconds", "Accept to last output token (server side)")
