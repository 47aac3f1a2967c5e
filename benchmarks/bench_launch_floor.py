"""The floor of a dependent kernel launch: a chain of N tiny Triton kernels, each reading what the one
before it wrote, captured in one CUDA graph and replayed; µs per link is the slope between a chain of N
and one of N/4 (the graph's own launch cancels). What one more LoRA kernel in a decode step costs before
it moves any adapter bytes.

Links: "bare" (each live program adds 1 to its own counter), "prologue" (as a LoRA kernel starts: the
batch header, the program's tile row, then its adapter's table entry, and only then the counter, which
the link before wrote), each over one program or over a padded grid of mostly empty programs (the
decode-graph shapes: 8B, 16 decodes over 4 adapters, the gate_up expand's 1,792 programs of which 448
are live), with and without programmatic dependent launch (PDL: the link lets the next one start at
once, and waits for its predecessor before it touches the counter and before it exits).

    python -m benchmarks.bench_launch_floor OUT_DIR [--chain 256] [--iters 20] [--rounds 4] [--smoke]

Prints one table, writes OUT_DIR/launch_floor.json and OUT_DIR/launch_floor.txt. Each variant's
counters are checked against the launches made (a link that read a stale counter would show)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from kernels import device_info  # noqa: E402
from kernels.batch_info import META_COLS  # noqa: E402

# (name, programs, live programs): one program, and the padded gate_up expand grid of 8B b16 4x r16
SHAPES = (("1 program", 1, 1), ("padded grid", 1792, 448))


@triton.jit
def _link(acc_ptr, meta_ptr, table_ptr, PROLOGUE: tl.constexpr, META: tl.constexpr, PDL: tl.constexpr):
    # One link: a live program adds its value to its counter (written by the link before). PDL: the next
    # link may launch now; this one waits before it reads the counter and before any return, so that its
    # completion implies its predecessor's.
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid >= tl.load(meta_ptr):  # past the batch header's tile count: an empty program
        if PDL:
            gdc_wait()
        return
    add = 1
    if PROLOGUE:  # as the LoRA kernels go on: the tile row, then its adapter's table entry
        slot = tl.load(meta_ptr + (pid + 1) * META + 2)
        add = tl.load(table_ptr + slot)
    if PDL:
        gdc_wait()
    tl.store(acc_ptr + pid, tl.load(acc_ptr + pid) + add)


class Chain:
    """A variant's buffers: per-program counters, a batch header of `live` tiles whose tile i names
    adapter i % 4, and an adapter table holding 1 for every adapter (so every link adds 1)."""

    def __init__(self, programs: int, live: int, prologue: bool, pdl: bool, device: torch.device):
        self.programs, self.live, self.prologue, self.pdl = programs, live, prologue, pdl
        self.acc = torch.zeros(programs, dtype=torch.int32, device=device)
        meta = torch.zeros((1 + programs, META_COLS), dtype=torch.int32)
        meta[0, 0] = live
        meta[1:, 2] = torch.arange(programs) % 4
        self.meta = meta.to(device)
        self.table = torch.ones(4, dtype=torch.int32, device=device)

    def launch(self, n: int) -> None:
        for _ in range(n):
            _link[(self.programs,)](
                self.acc, self.meta, self.table, PROLOGUE=self.prologue, META=META_COLS, PDL=self.pdl,
                num_warps=4, launch_pdl=self.pdl,
            )  # fmt: skip

    def check(self, links: int) -> None:
        """Every live counter holds `links`, every other zero."""
        got = self.acc.cpu()
        want = torch.zeros_like(got)
        want[: self.live] = links
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0, 0])
            raise AssertionError(f"program {bad}'s counter is {int(got[bad])}, expected {int(want[bad])}")


def link_us(chain: Chain, n: int, iters: int, rounds: int, device: torch.device) -> tuple[float, int]:
    """Median µs per link (slope of an n-link graph over an n/4-link one) and the links launched."""
    short = max(1, n // 4)
    if device.type != "cuda":  # the interpreter: eager, the script's check only
        t0 = time.perf_counter()
        chain.launch(n)
        return (time.perf_counter() - t0) / n * 1e6, n
    chain.launch(1)  # compile outside the capture
    torch.cuda.synchronize(device)
    graphs = {}
    for k in (short, n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain.launch(k)
        graphs[k] = g
    launched = 1
    samples = []
    for r in range(rounds):
        times = {}
        for k in (short, n) if r % 2 == 0 else (n, short):
            graphs[k].replay()  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graphs[k].replay()
            end.record()
            end.synchronize()
            times[k] = start.elapsed_time(end) * 1e3 / iters
            launched += k * (iters + 1)
        samples.append((times[n] - times[short]) / (n - short))
    return statistics.median(samples), launched


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--chain", type=int, default=256, help="links in the long graph (8B: LoRA kernels a step)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="eager on the CPU interpreter, a short chain")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        a.chain, a.iters, a.rounds = 8, 1, 1
    pdls = (False, True) if device_info.pdl(device) else (False,)
    rows = []
    for shape, programs, live in SHAPES:
        for prologue in (False, True):
            for pdl in pdls:
                chain = Chain(programs, live, prologue, pdl, device)
                us, launched = link_us(chain, a.chain, a.iters, a.rounds, device)
                chain.check(launched)
                rows.append(
                    dict(shape=shape, programs=programs, live=live, link="prologue" if prologue else "bare",
                         pdl=pdl, us_per_link=us)
                )  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    lines = ["| link | grid (live) | PDL | µs per link |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['link']} | {r['programs']:,} ({r['live']:,}) | {'on' if r['pdl'] else 'off'} | "
            f"{r['us_per_link']:.2f} |"
        )
    text = "\n".join(lines)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_floor.json").write_text(json.dumps(dict(device=name, args=vars(a), rows=rows), indent=1))
    (out / "launch_floor.txt").write_text(f"{name}, chain of {a.chain}\n{text}\n")
    print(f"{name}, chain of {a.chain}\n{text}")


if __name__ == "__main__":
    main()
