"""Session 12, call 3: does a step's small host-to-device input copy queue behind an adapter's layer
copies issued just before it on another stream (call 2's traces suggest so), and what avoids that?

32 copies of 10 MiB (pinned source) on a load stream, then on the compute stream a 48 KiB input copy and
a tiny kernel. Printed: ms from the common start until the compute stream's work is done, and until the
load stream's copies are done (medians of 20). Variants: the input copy issued before or after the load's
copies; by the copy engine (cudaMemcpyAsync) or by a kernel that reads the pinned buffer through its
device mapping (UVA); stream priorities; CUDA_DEVICE_MAX_CONNECTIONS (a child process per value).
    python copy_queue.py"""

import os
import statistics
import subprocess
import sys

import torch

L, LAYER = 32, 10 << 20
SMALL = 48 << 10


class _Cai:
    """A device view of pinned host memory (UVA: the host address is valid on the device)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def run(label: str, priorities: tuple[int, int] = (0, 0)) -> None:
    dev = torch.device("cuda")
    src = torch.empty(L * LAYER, dtype=torch.uint8).pin_memory()
    dst = torch.empty(L * LAYER, dtype=torch.uint8, device=dev)
    small_src = torch.randint(0, 255, (SMALL,), dtype=torch.uint8).pin_memory()
    small_dst = torch.empty(SMALL, dtype=torch.uint8, device=dev)
    uva = torch.as_tensor(_Cai(small_src.data_ptr(), SMALL), device=dev)
    load = torch.cuda.Stream(priority=priorities[0])
    compute = torch.cuda.Stream(priority=priorities[1])

    def big(done):
        with torch.cuda.stream(load):
            for i in range(L):
                dst[i * LAYER : (i + 1) * LAYER].copy_(src[i * LAYER : (i + 1) * LAYER], non_blocking=True)
            done.record(load)

    def small(how, done):
        with torch.cuda.stream(compute):
            if how == "memcpy":
                small_dst.copy_(small_src, non_blocking=True)
            else:  # an elementwise kernel reading the pinned buffer through UVA (no copy engine)
                torch.bitwise_or(uva, 0, out=small_dst)
            small_dst.add_(0)
            done.record(compute)

    for order in ("loads first", "input first"):
        for how in ("memcpy", "uva kernel"):
            t_small, t_big = [], []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = torch.cuda.Event(enable_timing=True)
                e_small = torch.cuda.Event(enable_timing=True)
                e_big = torch.cuda.Event(enable_timing=True)
                gate = torch.cuda.Event()
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(2_000_000)  # hold both streams until everything is queued
                    t0.record(compute)
                    gate.record(compute)
                load.wait_event(gate)
                if order == "loads first":
                    big(e_big)
                    small(how, e_small)
                else:
                    small(how, e_small)
                    big(e_big)
                torch.cuda.synchronize()
                t_small.append(t0.elapsed_time(e_small))
                t_big.append(t0.elapsed_time(e_big))
            assert torch.equal(small_dst.cpu(), small_src)
            print(
                f"{label:28s} {order:12s} {how:10s}: input done at {statistics.median(t_small):6.3f} ms, "
                f"loads done at {statistics.median(t_big):6.3f} ms"
            )


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1])
        return
    run("default")
    lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest): e.g. (0, -5)
    run(f"load prio {lo}, compute {hi}", (lo, hi))
    for n in ("1", "32"):
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=n)
        subprocess.run([sys.executable, __file__, f"MAX_CONNECTIONS={n}"], env=env, check=True)


if __name__ == "__main__":
    main()
