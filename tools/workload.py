"""The `--workload` file: JSONL, one request per line (arrival, prompt or lengths, adapter, max tokens),
with its reader, writer and a seeded generator (Poisson or closed-loop arrivals, length ranges, adapter
popularity, shared prefixes: `shared_prefix.py`). Same spec and seed → byte-identical file.
`python -m tools.workload --out FILE [flags]`."""

from __future__ import annotations

import argparse
import hashlib
import math
import random
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

# Synthetic prompts draw ids from here: the generated tokenizer's byte alphabet (ids 0 and 1 are BOS and
# EOS), ordinary tokens in Llama-3's vocabulary too. Part of the format: changing it changes replays.
SYNTH_TOKENS = (2, 258)
DISTRIBUTIONS = "uniform | distinct | zipf:ALPHA | bursty:PHASES"


class WorkloadRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One line. Exactly one of `prompt` (text), `prompt_ids` or `input_len` (a synthetic prompt of that
    many ids made from `prompt_seed`) is set; `sampling` holds extra SamplingParams fields."""

    arrival: float  # seconds from the start of the run
    adapter: str | None  # None: base model only (always written, as null)
    max_tokens: int
    input_len: int | None = None
    prompt_seed: int = 0
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: dict[str, Any] = {}

    def check(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_ids, self.input_len)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, prompt_ids, input_len must be set")
        if self.max_tokens < 1 or self.arrival < 0 or not math.isfinite(self.arrival):
            raise ValueError(f"bad max_tokens {self.max_tokens} or arrival {self.arrival}")
        if (self.input_len is not None and self.input_len < 1) or self.prompt_ids == []:
            raise ValueError("empty prompt")

    def prompt_value(self) -> str | list[int]:
        """The prompt to send: its text, or its token ids (given or synthesized)."""
        if self.prompt is not None:
            return self.prompt
        if self.prompt_ids is not None:
            return list(self.prompt_ids)
        assert self.input_len is not None
        return synth_prompt(self.input_len, self.prompt_seed)


def synth_prompt(n: int, seed: int) -> list[int]:
    # Only Random.random() is guaranteed to repeat across Python versions for a given int seed.
    rng, (lo, hi) = random.Random(seed), SYNTH_TOKENS
    return [lo + int(rng.random() * (hi - lo)) for _ in range(n)]


def sub_seed(seed: int, *parts: object) -> int:
    """An independent 63-bit seed per (seed, stream, ...): changing one knob leaves other draws alone."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkloadRequest)


def dumps(requests: Iterable[WorkloadRequest]) -> bytes:
    return b"".join(_encoder.encode(r) + b"\n" for r in requests)


def write_workload(path: str | Path, requests: Sequence[WorkloadRequest]) -> None:
    Path(path).write_bytes(dumps(requests))


def read_workload(path: str | Path) -> list[WorkloadRequest]:
    return loads(Path(path).read_bytes(), str(path))


def loads(data: bytes, source: str = "<workload>") -> list[WorkloadRequest]:
    """The requests of workload JSONL `data` (what `dumps` writes), each checked; errors name
    `source` and the line."""
    out = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = _decoder.decode(line)
            req.check()
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            raise ValueError(f"{source}:{n}: {exc}") from None
        out.append(req)
    return out


def workload_digest(requests: Sequence[WorkloadRequest]) -> str:
    """sha256 of the canonical encoding: equal digests mean two runs saw exactly the same requests."""
    return hashlib.sha256(dumps(requests)).hexdigest()


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 100
    request_rate: float = math.inf  # Poisson arrivals; inf: all arrive at 0 (closed loop / saturation)
    input_len: tuple[int, int] = (256, 256)  # inclusive range; equal ends mean a fixed length
    output_len: tuple[int, int] = (128, 128)
    prompt_file: str | None = None  # JSONL of {"prompt"|"prompt_ids", optional "output_len"}, cycled
    adapters: tuple[str, ...] = ()
    distribution: str = "uniform"
    base_share: float = 0.0  # share of requests that use no adapter
    seed: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    # > 0: each adapter (and the base model) has its own system prompt of this many tokens, which starts
    # every prompt of it; input_len is then the user suffix (tools/shared_prefix.py)
    shared_prefix: int = 0
    turns: int = 1  # with shared_prefix: turns per chat session, each resending the session's history


def generate_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    if spec.num_prompts < 1 or not 0.0 <= spec.base_share <= 1.0 or spec.request_rate <= 0:
        raise ValueError("need num_prompts >= 1, 0 <= base_share <= 1 and request_rate > 0")
    n, seed = spec.num_prompts, spec.seed
    arrivals = _arrivals(n, spec.request_rate, random.Random(sub_seed(seed, "arrival")))
    adapters = _adapters(n, spec.adapters, spec.distribution, random.Random(sub_seed(seed, "adapter")))
    base_rng = random.Random(sub_seed(seed, "base"))
    in_rng, out_rng = random.Random(sub_seed(seed, "input")), random.Random(sub_seed(seed, "output"))
    prompts = _read_prompt_file(spec.prompt_file) if spec.prompt_file else []
    if spec.shared_prefix or spec.turns != 1:
        from tools.shared_prefix import shared_prefix_requests

        if prompts or spec.shared_prefix < 1 or spec.turns < 1:
            raise ValueError("--turns needs --shared-prefix N >= 1 (and no --prompt-file)")
        return shared_prefix_requests(spec, arrivals, adapters, base_rng)
    out = []
    for i in range(n):
        is_base = base_rng.random() < spec.base_share or not spec.adapters
        max_tokens = _draw(out_rng, spec.output_len)
        kw: dict[str, Any] = {}
        if prompts:
            line = prompts[i % len(prompts)]
            kw = {k: line[k] for k in ("prompt", "prompt_ids") if k in line}
            max_tokens = int(line.get("output_len", max_tokens))
        else:
            kw = {"input_len": _draw(in_rng, spec.input_len), "prompt_seed": sub_seed(seed, "prompt", i)}
        req = WorkloadRequest(
            arrival=arrivals[i],
            adapter=None if is_base else adapters[i],
            max_tokens=max_tokens,
            sampling=dict(spec.sampling),
            **kw,
        )
        req.check()
        out.append(req)
    return out


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    lo, hi = span
    return lo + int(rng.random() * (hi - lo + 1))


def _arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Request 0 at 0, then exponential gaps of mean 1/rate; rounded to µs so files stay readable."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += -math.log(1.0 - rng.random()) / rate
    return out


def _adapters(n: int, names: Sequence[str], dist: str, rng: random.Random) -> list[str | None]:
    if not names:
        return [None] * n
    kind, _, arg = dist.partition(":")
    k = len(names)
    if kind == "uniform" and not arg:
        return [names[int(rng.random() * k)] for _ in range(n)]
    if kind == "distinct" and not arg:
        return [names[i % k] for i in range(n)]  # consecutive requests never share an adapter (n ≤ k)
    if kind == "zipf" and arg:
        alpha = float(arg)
        cum = list(_cumsum(1.0 / (r + 1) ** alpha for r in range(k)))  # rank 1 = first name
        return [names[min(bisect_right(cum, rng.random() * cum[-1]), k - 1)] for _ in range(n)]
    if kind == "bursty" and arg and int(arg) >= 1:
        phases = int(arg)
        groups = [
            list(names[p * k // phases : (p + 1) * k // phases]) or [names[p % k]] for p in range(phases)
        ]
        out = []
        for i in range(n):
            group = groups[i * phases // n]  # equal runs of requests, each over its own adapters
            out.append(group[int(rng.random() * len(group))])
        return out
    raise ValueError(f"--adapter-distribution {dist!r}: expected {DISTRIBUTIONS}")


def _cumsum(xs: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for x in xs:
        total += x
        yield total


def _read_prompt_file(path: str) -> list[dict[str, Any]]:
    lines = [msgspec.json.decode(b) for b in Path(path).read_bytes().splitlines() if b.strip()]
    if not lines or not all(isinstance(x, dict) and ("prompt" in x or "prompt_ids" in x) for x in lines):
        raise ValueError(f"--prompt-file {path}: every line needs 'prompt' or 'prompt_ids'")
    return lines


def parse_span(text: str) -> tuple[int, int]:
    """`N` (fixed) or `LO:HI` (uniform, inclusive)."""
    lo, _, hi = text.partition(":")
    span = (int(lo), int(hi or lo))
    if span[0] < 1 or span[1] < span[0]:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return span


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload generation (ignored with --workload)")
    g.add_argument("--num-prompts", type=int, default=100, metavar="N")
    g.add_argument("--request-rate", type=float, default=math.inf, metavar="R", help="req/s, Poisson")
    g.add_argument("--input-len", type=parse_span, default=(256, 256), metavar="N|LO:HI")
    g.add_argument("--output-len", type=parse_span, default=(128, 128), metavar="N|LO:HI")
    g.add_argument("--prompt-file", metavar="JSONL", help='lines of {"prompt"|"prompt_ids", "output_len"?}')
    g.add_argument("--adapters", default="", metavar="A,B,C", help="adapter names")
    g.add_argument("--num-adapters", type=int, default=0, metavar="N", help="names PREFIX0..PREFIX{N-1}")
    g.add_argument("--adapter-prefix", default="adapter", metavar="PREFIX")
    g.add_argument("--adapter-distribution", default="uniform", metavar="DIST", help=DISTRIBUTIONS)
    g.add_argument("--base-share", type=float, default=0.0, metavar="F", help="share of base-only requests")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="each adapter (and the base model) has its own N-token system prompt, which starts each of "
        "its prompts; --input-len is then the user suffix",
    )
    g.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="T",
        help="with --shared-prefix: chat sessions of T turns, each prompt resending the session's history",
    )


def spec_from_args(ns: argparse.Namespace) -> WorkloadSpec:
    names = [a for a in ns.adapters.split(",") if a]
    names += [f"{ns.adapter_prefix}{i}" for i in range(ns.num_adapters)]
    return WorkloadSpec(
        num_prompts=ns.num_prompts,
        request_rate=ns.request_rate,
        input_len=ns.input_len,
        output_len=ns.output_len,
        prompt_file=ns.prompt_file,
        adapters=tuple(dict.fromkeys(names)),
        distribution=ns.adapter_distribution,
        base_share=ns.base_share,
        seed=ns.seed,
        sampling={"temperature": ns.temperature} if ns.temperature else {},
        shared_prefix=ns.shared_prefix,
        turns=ns.turns,
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.workload", description=__doc__)
    p.add_argument("--out", required=True, metavar="FILE", help="workload JSONL to write")
    add_workload_arguments(p)
    ns = p.parse_args(argv)
    try:
        reqs = generate_workload(spec_from_args(ns))
    except ValueError as exc:
        p.error(str(exc))
    write_workload(ns.out, reqs)
    base = sum(r.adapter is None for r in reqs)
    print(f"wrote {len(reqs)} requests ({base} base-only) to {ns.out}, sha256 {workload_digest(reqs)[:16]}")


if __name__ == "__main__":
    main()
