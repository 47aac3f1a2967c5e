"""Prefix caching through the served pipeline (`lorapipe serve` as a subprocess, CPU, tiny model): a
prompt sent twice reuses its cached pages (the Prometheus counters say so) and gives PEFT's greedy
tokens both times; an adapter unloaded and loaded again under the same name with other weights gives
the new weights' tokens, never the old KV's; `--no-prefix-caching` reaches the planner's policy."""

from __future__ import annotations

import argparse
import time

import pytest

from runtime.engine_args import planner_policy
from runtime.serve_args import add_serve_arguments, from_namespace
from tests.integration.serving import serve
from tests.peft_reference import PeftReference

pytestmark = pytest.mark.timeout(300)

PROMPT = [(13 * i + 5) % 250 + 2 for i in range(70)]  # 4 full pages of 16 and 6 tokens
MAX_TOKENS = 5


def _peft_greedy(ref: PeftReference, ids: list[int], adapter: str) -> list[int]:
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        out.append(int(ref.logits(ids + out, adapter)[-1].argmax()))
    return out


def test_cached_prompt_and_reloaded_adapter_through_the_server(tiny_llama, llama_adapters):
    ref = PeftReference(tiny_llama, {"full8": llama_adapters["full8"], "qv5": llama_adapters["qv5"]})
    want_old, want_new = _peft_greedy(ref, PROMPT, "full8"), _peft_greedy(ref, PROMPT, "qv5")
    assert want_old != want_new, "the two adapters must tell their KV apart"
    flags = ("--max-lora-rank", "16", "--num-pages", "256", "--allow-any-adapter-path")
    with serve(tiny_llama, {}, *flags) as s:
        c = s.client()
        c.load_adapter("swap", str(llama_adapters["full8"]))
        outs = [
            c.generate(PROMPT, "swap", max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for _ in range(2)
        ]
        assert outs == [want_old, want_old]
        assert s.metric("lorapipe_prefix_cache_hits_total", "scheduler") == 64  # the second: 4 pages
        assert s.metric("lorapipe_prefix_cache_queries_total", "scheduler") == 2 * len(PROMPT)
        assert s.metric("lorapipe_prefix_cache_pages", "scheduler") >= 4
        c.unload_adapter("swap")
        deadline = time.monotonic() + 30
        while "swap" in {e.name for e in c.list_adapters()}:
            assert time.monotonic() < deadline, "the adapter was never removed"
        c.load_adapter("swap", str(llama_adapters["qv5"]))  # the same name, other weights
        assert c.generate(PROMPT, "swap", max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == want_new
        assert s.metric("lorapipe_prefix_cache_hits_total", "scheduler") == 64


def test_no_prefix_caching_reaches_the_planner():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    on = from_namespace(parser.parse_args(["--model", "m"]))
    off = from_namespace(parser.parse_args(["--model", "m", "--no-prefix-caching"]))
    assert planner_policy(on).prefix_caching and not planner_policy(off).prefix_caching
