"""Session 11, call 1: what a CUDA graph's external-event wait node waits for, and what it costs.

1. semantics: gate recorded after a short sleep (R1), the graph launched, then the gate recorded again after
   a long sleep (R2) before the graph's node could run. Launch-time semantics: the graph ends near R1;
   execution-time semantics: near R2.
2. cycle: the graph waits on the gate; afterwards the side stream waits for the graph (wait_stream) and
   records the gate again. Execution-time semantics would deadlock (run in a child with a timeout).
3. a never-recorded external event at capture: is a wait node made at all?
4. cost: replay of 32 x (tiny kernel) against 32 x (wait on a completed gate + tiny kernel).
"""

import subprocess
import sys
import time

import torch

dev = torch.device("cuda")
CYC_MS = None


def cycles_per_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / a.elapsed_time(b)


def graph_waiting_on(gate, x):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            gate.wait(torch.cuda.current_stream())
            x.add_(1)
    torch.cuda.synchronize()
    return g


def semantics():
    cpm = cycles_per_ms()
    side = torch.cuda.Stream()
    gate = torch.cuda.Event(external=True)
    gate.record(side)  # create it
    x = torch.zeros(1, device=dev)
    g = graph_waiting_on(gate, x)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    r1 = torch.cuda.Event(enable_timing=True)
    r2 = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0.record(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(50 * cpm))
    gate.record(side)
    r1.record(side)
    g.replay()
    end.record()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(400 * cpm))
    gate.record(side)
    r2.record(side)
    torch.cuda.synchronize()
    print(
        f"semantics: R1 at {t0.elapsed_time(r1):.1f} ms, R2 at {t0.elapsed_time(r2):.1f} ms, "
        f"graph done at {t0.elapsed_time(end):.1f} ms, x={x.item()}"
    )
    launch = t0.elapsed_time(end) < t0.elapsed_time(r2) - 100
    print("semantics:", "LAUNCH-TIME" if launch else "EXECUTION-TIME")


def cycle():
    cpm = cycles_per_ms()
    side = torch.cuda.Stream()
    gate = torch.cuda.Event(external=True)
    gate.record(side)
    x = torch.zeros(1, device=dev)
    g = graph_waiting_on(gate, x)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(50 * cpm))
    gate.record(side)
    g.replay()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(10 * cpm))
    gate.record(side)
    torch.cuda.synchronize()
    print("cycle: finished, x =", x.item())


def never_recorded():
    cpm = cycles_per_ms()
    side = torch.cuda.Stream()
    gate = torch.cuda.Event(external=True)  # not recorded before capture
    x = torch.zeros(1, device=dev)
    g = graph_waiting_on(gate, x)
    t0 = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0.record(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(200 * cpm))
    gate.record(side)
    g.replay()
    end.record()
    torch.cuda.synchronize()
    print(
        f"never recorded at capture: graph done at {t0.elapsed_time(end):.1f} ms after a 200 ms gate "
        f"({'WAITED' if t0.elapsed_time(end) > 150 else 'NO WAIT NODE'})"
    )


def cost():
    side = torch.cuda.Stream()
    gates = [torch.cuda.Event(external=True) for _ in range(32)]
    for e in gates:
        e.record(side)
    x = torch.zeros(4096, device=dev)
    res = {}
    for name, use in (("plain", False), ("gated", True)):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            for e in gates:
                if use:
                    e.wait(torch.cuda.current_stream())
                x.mul_(1.0001)
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(200):
                g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 200 * 1e3)
        res[name] = sorted(times)[3]
        t = time.perf_counter()
        for _ in range(200):
            g.replay()
        host = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"cost {name}: {res[name]:.1f} us a replay (median of 7 x 200), host launch {host:.1f} us")
    print(f"cost: +{res['gated'] - res['plain']:.1f} us for 32 waits on completed gates")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        globals()[sys.argv[1]]()
        sys.exit(0)
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for part in ("semantics", "never_recorded", "cost", "cycle"):
        try:
            r = subprocess.run([sys.executable, __file__, part], timeout=60, capture_output=True, text=True)
            print(r.stdout.strip(), r.stderr.strip()[-2000:], f"[{part} rc={r.returncode}]")
        except subprocess.TimeoutExpired:
            print(f"[{part}] TIMED OUT after 60 s (a deadlock)")
