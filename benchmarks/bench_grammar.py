"""Structured output's host cost for xgrammar and llguidance on one tokenizer: the time to make a
grammar ready (compile and the matcher's first mask, median of REPEATS) and the time to compute one
token's mask while decoding a valid instance (mean, p50, p99), for a JSON schema, any JSON object and a
regex.

    python -m benchmarks.bpe_tokenizer TOK_DIR      # a 128k-token byte-level BPE
    python -m benchmarks.bench_grammar --tokenizer TOK_DIR OUT_DIR

Prints one table and writes OUT_DIR/bench_grammar.json. A library that is not installed is left out of
the table (xgrammar is not a dependency: install it beside the project to compare)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from runtime.synthetic.model import EOS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada.lovelace@example.org",
    "role": "admin",
    "tags": ["mathematics", "engines", "poetry", "analysis"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y"},
    "active": True,
    "score": 97.25,
}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4} \([A-Z][a-z]+\)"
REGEX_TEXT = "555-867-5309 (Jenny)"
REPEATS = 5  # fresh grammar and matcher each time (no compile cache): medians and pooled tokens


def cases() -> list[tuple[str, str, object, str]]:
    """(case, kind, spec, a text the grammar accepts)."""
    text = json.dumps(INSTANCE, separators=(",", ":"))
    return [
        ("json_schema", "json", SCHEMA, text),
        ("json_object", "json_object", None, text),
        ("regex", "regex", REGEX, REGEX_TEXT),
    ]


def _stats(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "tokens": len(us),
    }


def bench_llguidance(tok_json: str, vocab: int, eos: int, ids: dict[str, list[int]]) -> dict:
    import llguidance
    import llguidance.torch as lt

    t = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    out: dict = {"tokenizer_s": time.perf_counter() - t}
    mask = lt.allocate_token_bitmask(1, vocab)
    for case, kind, spec, _ in cases():
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        ready, times = [], []
        for _ in range(REPEATS):
            t = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            lt.fill_next_token_bitmask(matcher, mask)
            ready.append(time.perf_counter() - t)
            for tok in ids[case]:
                t = time.perf_counter()
                lt.fill_next_token_bitmask(matcher, mask)
                times.append(time.perf_counter() - t)
                ok = matcher.consume_token(tok)
                assert ok, (case, matcher.get_error())
        out[case] = {"ready_s": statistics.median(ready), **_stats(times)}
    return out


def bench_xgrammar(tok_dir: Path, vocab: int, eos: int, ids: dict[str, list[int]]) -> dict:
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out: dict = {"tokenizer_s": time.perf_counter() - t}
    mask = xgr.allocate_token_bitmask(1, vocab)
    for case, kind, spec, _ in cases():
        ready, times = [], []
        for _ in range(REPEATS):
            t = time.perf_counter()
            if kind == "json":
                compiled = compiler.compile_json_schema(json.dumps(spec))
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            else:
                compiled = compiler.compile_regex(spec)
            matcher = xgr.GrammarMatcher(compiled)
            matcher.fill_next_token_bitmask(mask)
            ready.append(time.perf_counter() - t)
            for tok in ids[case]:
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                times.append(time.perf_counter() - t)
                assert matcher.accept_token(tok), case
        out[case] = {"ready_s": statistics.median(ready), **_stats(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a directory holding tokenizer.json")
    ap.add_argument("--eos", default=EOS, help="the EOS token's text")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok_dir = Path(args.tokenizer)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(args.eos)
    if eos is None:
        ap.error(f"the tokenizer has no token {args.eos!r} (--eos)")
    ids = {case: tok.encode(text, add_special_tokens=False).ids for case, _, _, text in cases()}
    results: dict = {"vocab": vocab}
    try:
        results["llguidance"] = bench_llguidance(tok.to_str(), vocab, eos, ids)
    except ImportError:
        pass
    try:
        results["xgrammar"] = bench_xgrammar(tok_dir, vocab, eos, ids)
    except ImportError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_grammar.json").write_text(json.dumps(results, indent=2))
    print(f"vocabulary {vocab} tokens")
    print(f"{'library':<11} {'case':<12} {'ready ms':>9} {'mask mean us':>13} {'p50 us':>8} {'p99 us':>8}")
    for lib in ("llguidance", "xgrammar"):
        for case, *_ in cases():
            r = results.get(lib, {}).get(case)
            if r:
                print(
                    f"{lib:<11} {case:<12} {r['ready_s'] * 1e3:>9.1f} {r['mean_us']:>13.1f} "
                    f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f}"
                )


if __name__ == "__main__":
    main()
