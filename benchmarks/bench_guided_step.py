"""One decode step's structured-output host work, on the CPU: the worker's own GuidedMasks (llguidance
matchers, its thread pool) for REQUESTS requests of bench_sampling_features.py's `guided` schema over a
BPE tokenizer, stepped through STEPS tokens. Each step is one job on the masks thread, as a launch starts
it: `feed` (the step before's token of every matcher, one pooled call) and `mask` (every next-token
mask, one pooled call), both on the masks thread; `start` (the step thread's part in starting it), while
the step thread then runs BUSY_MS of Python of its own (as it launches the forward) and `wait`s for the
job; `unpack` (the packed words to [n, V] bool, here on the CPU: on a GPU it is a device op). The tokens are
drawn uniformly from each mask, so the matchers pass through the positions a random model's greedy
decoding reaches (the object's forced start, then strings and separators). Also each matcher's mask
alone on one thread (its CPU time, without the pool; a pass of its own, `serial` in the table, whose mask
column is their sum a step): the per-position cost a core count divides.

    python -m benchmarks.bpe_tokenizer TOK_DIR      # the bench's 128k-token byte-level BPE
    python -m benchmarks.bench_guided_step --tokenizer TOK_DIR OUT_DIR [--threads 14,1] [--templates 1,14] \
        [--busy-ms 2]

`--templates 1` is every matcher a copy of one compiled grammar (copies share its lexer's lock, so the
pool runs them one at a time); the default is one template per pool thread, as the worker does. Prints
one table (per thread and template count: milliseconds a step per phase) and one line on whether a
matcher's copies share its lexer (`lexer_sharing`), and writes OUT_DIR/guided_step.json with the
per-step series and the serial per-matcher microseconds by step."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_sampling_features import LONG_SCHEMA
from proto.sampling import Guided
from runtime.synthetic.model import EOS
from stages.worker.guided import MASK_THREADS, GuidedMasks

VOCAB = 128_256  # the 1b and 8b presets' logits width


def _eos_id(tok_dir: Path) -> int:
    for added in json.loads((tok_dir / "tokenizer.json").read_text()).get("added_tokens", []):
        if added["content"] == EOS:
            return added["id"]
    raise SystemExit(f"{tok_dir}/tokenizer.json has no {EOS} token")


def run(
    tok_dir: Path,
    requests: int,
    steps: int,
    threads: int,
    templates: int,
    seed: int,
    serial: bool,
    busy_ms: float = 0.0,
) -> dict:
    eos = [_eos_id(tok_dir)]
    guided = GuidedMasks(str(tok_dir), VOCAB, eos, torch.device("cpu"), threads=threads, templates=templates)
    spec = Guided("json", json.dumps(LONG_SCHEMA))
    ids = [f"r{i}" for i in range(requests)]
    for rid in ids:
        guided.add(rid, spec)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    rng = np.random.default_rng(seed)
    phases: dict[str, list[float]] = {"feed": [], "mask": [], "start": [], "wait": [], "unpack": []}
    serial_us: list[list[float]] = []  # [step][request]
    words = guided.words
    alone = np.zeros((requests, words), dtype=np.int32)  # the serial pass's masks
    guided.start(ids[:1], background=False).wait()  # builds the tokenizer and the first matcher
    for step in range(steps):
        feed = [(rid, outputs[rid], 0, len(outputs[rid])) for rid in ids]
        if serial:  # each mask alone on this thread: its CPU time
            guided.feed(feed)
            row = []
            for k, rid in enumerate(ids):
                matcher = guided._matcher(guided._requests[rid])
                c0 = time.thread_time()
                matcher.unsafe_compute_mask_ptr(alone[k].ctypes.data, words * 4)
                row.append(1e6 * (time.thread_time() - c0))
            serial_us.append(row)
            bits = np.unpackbits(alone.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        else:
            before = dict(guided.seconds)
            job = guided.start(ids, feed=feed)
            _busy(busy_ms)  # the step thread's own work meanwhile (the forward's launch)
            t1 = time.perf_counter()
            job.wait()
            t2 = time.perf_counter()
            bits = job.result(VOCAB).numpy()  # [n, V] bool
            spent = {k: v - before[k] for k, v in guided.seconds.items()}
            phases["feed"].append(spent["job_feed"])
            phases["mask"].append(spent["job_mask"])
            phases["start"].append(spent["start"])
            phases["wait"].append(t2 - t1)
            phases["unpack"].append(time.perf_counter() - t2)
            if job.failed:
                raise SystemExit(f"grammars failed: {job.failed}")
        for k, rid in enumerate(ids):
            if guided.stopped(rid):
                raise SystemExit(f"{rid} ended at step {step}: the schema should outlast --steps")
            outputs[rid].append(_draw(bits[k], rng))
    guided.close()
    found: dict = {"threads": threads, "templates": templates, "requests": requests, "steps": steps}
    for name, series in phases.items() if not serial else ():
        found[name + "_ms"] = {
            "mean": 1e3 * statistics.fmean(series[1:]),  # the first step also builds every matcher
            "p50": 1e3 * statistics.median(series[1:]),
            "max": 1e3 * max(series[1:]),
            "first": 1e3 * series[0],
        }
    if serial_us:
        per_step = [statistics.fmean(r) for r in serial_us]
        flat = sorted(x for r in serial_us[1:] for x in r)
        found["serial_mask_us"] = {
            "mean": statistics.fmean(flat),
            "p50": flat[len(flat) // 2],
            "p99": flat[int(len(flat) * 0.99)],
            "max": flat[-1],
            "per_step_mean": [round(x, 1) for x in per_step],
            "per_step_sum_ms": [round(sum(r) / 1e3, 3) for r in serial_us],
        }
    found["sample_text"] = _text(tok_dir, outputs[ids[0]])  # what the first request wrote
    return found


def lexer_sharing(tok_dir: Path) -> dict[str, float]:
    """Whether a matcher's copies share its lexer (and so its lock): CPU milliseconds of the masks along
    one text of a grammar with many words, for a first copy (cold lexer), a second copy of the same
    template after it, and a matcher compiled apart after both. Shared, the second copy finds the
    lexer states the first one built and costs a fraction of the others."""
    import random

    import llguidance

    from runtime.common.grammar import matcher_tokenizer

    tok = matcher_tokenizer((tok_dir / "tokenizer.json").read_text(), VOCAB, [_eos_id(tok_dir)])
    rnd = random.Random(0)
    words = [
        "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(4, 12)))
        for _ in range(400)
    ]
    alt = "|".join(words)
    grammar = llguidance.LLMatcher.grammar_from_regex(f"({alt})( ({alt})){{0,40}}")
    tokens = tok.tokenize_str(" ".join(rnd.choice(words) for _ in range(30)))
    mask = np.zeros((VOCAB + 31) // 32, dtype=np.int32)

    def cpu_ms(matcher: llguidance.LLMatcher) -> float:
        spent = 0.0
        for t in tokens:
            c0 = time.thread_time()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            spent += time.thread_time() - c0
            assert matcher.consume_token(t), matcher.get_error()
        return 1e3 * spent

    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    first, second = template.deep_copy(), template.deep_copy()
    found = {"first_copy_ms": cpu_ms(first), "second_copy_ms": cpu_ms(second)}
    found["apart_ms"] = cpu_ms(llguidance.LLMatcher(tok, grammar, log_level=0))
    return found


def _busy(ms: float) -> None:
    """Pure Python for `ms` milliseconds, holding the GIL as a forward's launch mostly does."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _draw(allowed: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn uniformly from the [V] mask `allowed` (most masks allow most of the vocabulary:
    a few random picks find one before the whole row is searched)."""
    for t in rng.integers(0, allowed.shape[0], 16):
        if allowed[t]:
            return int(t)
    return int(rng.choice(np.flatnonzero(allowed)))


def _text(tok_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).decode(ids)[:300]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory holding tokenizer.json")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", default=str(MASK_THREADS), help="pool sizes to run, comma-separated")
    ap.add_argument(
        "--templates",
        default="",
        help="templates a grammar's matchers copy, comma-separated (0 or default: as many as threads)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--busy-ms", type=float, default=0.0, help="the step thread's own Python while a job runs"
    )
    ap.add_argument("--no-serial", action="store_true", help="skip the one-thread per-matcher masks")
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    rows = []
    print(
        f"| threads | templates | feed ms/step | mask ms/step | start ms/step "
        f"| wait after {a.busy_ms} ms busy | unpack ms/step (CPU) | one mask us |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    combos = [
        (t, k or t) for t in map(int, a.threads.split(",")) for k in map(int, (a.templates or "0").split(","))
    ]
    for threads, templates in combos:
        row = run(
            a.tokenizer, a.requests, a.steps, threads, templates, a.seed, serial=False, busy_ms=a.busy_ms
        )
        rows.append(row)
        print(
            f"| {threads} | {templates} | {row['feed_ms']['mean']:.3f} | {row['mask_ms']['mean']:.3f} "
            f"| {row['start_ms']['mean']:.3f} | {row['wait_ms']['mean']:.3f} "
            f"| {row['unpack_ms']['mean']:.3f} | - |"
        )
    if not a.no_serial:
        row = run(a.tokenizer, a.requests, a.steps, 1, 1, a.seed, serial=True)
        rows.append(row)
        one = row["serial_mask_us"]
        per_step = sum(one["per_step_sum_ms"]) / a.steps
        print(f"| serial | 1 | - | {per_step:.3f} | - | - | - | {one['mean']:.1f} (p99 {one['p99']:.0f}) |")
    sharing = lexer_sharing(a.tokenizer)
    print(
        f"lexer shared by copies? masks of a first copy {sharing['first_copy_ms']:.1f} ms CPU, a second "
        f"copy after it {sharing['second_copy_ms']:.1f}, a matcher compiled apart {sharing['apart_ms']:.1f}"
    )
    rows.append({"lexer_sharing": sharing})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "guided_step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
