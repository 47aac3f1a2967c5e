"""Compare the greedy tokens two `benchmarks/bench_tp.py` results recorded (same model, prompts and
adapters, different tensor-parallel sizes): per kind, how many sequences are equal throughout and, for
the others, where the first difference is.

python -m benchmarks.compare_greedy tp1.json tp2.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str]) -> None:
    one, two = (json.loads(Path(p).read_text())["greedy_tokens"] for p in argv[1:3])
    for kind in sorted(set(one) & set(two)):
        diffs = [first_difference(a, b) for a, b in zip(one[kind], two[kind], strict=True)]
        same = sum(d is None for d in diffs)
        firsts = sorted(d for d in diffs if d is not None)
        print(json.dumps({"kind": kind, "sequences": len(diffs), "equal": same, "first_differences": firsts}))


if __name__ == "__main__":
    main(sys.argv)
