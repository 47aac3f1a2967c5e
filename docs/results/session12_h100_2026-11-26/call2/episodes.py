"""One-off analysis for session 12, call 2: the device timeline of each request on an idle server.

Reads a worker trace (`--profile-dir`, device activity only), splits it into episodes at GPU-idle gaps of
more than 40 ms (at 1 req/s each request runs alone), and prints for each episode, in ms from its first
device event: the large host-to-device copies (adapter rows), the first kernel on the compute stream, the
compute stream's idle gaps over 0.3 ms before the first device-to-host copy (the first token's readback),
and that readback.
    python episodes.py TRACE.json.gz [...]"""

import sys

from runtime.common.gpu_timeline import load_trace

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def start(e: dict) -> float:
    return float(e["ts"])


def end(e: dict) -> float:
    return float(e["ts"]) + float(e["dur"])


def split(events: list[dict], gap_us: float = 40_000) -> list[list[dict]]:
    episodes, cur, last = [], [], None
    for e in events:
        if last is not None and start(e) - last > gap_us:
            episodes.append(cur)
            cur = []
        cur.append(e)
        last = max(last or 0.0, end(e))
    return episodes + [cur]


def describe(k: int, ep: list[dict]) -> None:
    t0 = start(ep[0])

    def ms(t: float) -> str:
        return f"{(t - t0) / 1e3:.2f}"

    kernels = [e for e in ep if e["cat"] == "kernel"]
    if not kernels:
        return
    copies = [e for e in ep if e["cat"] == "gpu_memcpy"]
    big = [e for e in copies if "HtoD" in e["name"] and float(e.get("args", {}).get("bytes", 0)) >= 1 << 20]
    streams: dict = {}
    for e in kernels:
        streams.setdefault(e.get("args", {}).get("stream"), []).append(e)
    compute = max(streams, key=lambda s: len(streams[s]))
    ck = streams[compute]
    d2h = [e for e in copies if "DtoH" in e["name"]]
    parts = [f"  ep {k}: {len(ep)} events, span {ms(max(end(e) for e in ep))} ms"]
    if big:
        mib = sum(float(e["args"].get("bytes", 0)) for e in big) / 2**20
        span = f"{ms(start(big[0]))}-{ms(max(end(e) for e in big))} ms"
        parts.append(f"H2D >=1MB: {len(big)} copies {mib:.0f} MiB {span}")
    parts.append(f"compute stream {compute}: first kernel {ms(start(ck[0]))} ms")
    if d2h:
        parts.append(f"first DtoH {ms(start(d2h[0]))} ms")
    print("; ".join(parts))
    if k < 4 and d2h:
        t, gaps = start(ck[0]), []
        for e in ck:
            if start(e) > start(d2h[0]):
                break
            if start(e) - t > 300:
                gaps.append(f"{ms(t)}+{(start(e) - t) / 1e3:.2f}")
            t = max(t, end(e))
        print("     compute gaps > 0.3 ms before the first readback (at+ms):", ", ".join(gaps) or "none")


def main() -> None:
    for path in sys.argv[1:]:
        events = sorted(
            (e for e in load_trace(path) if e.get("ph") == "X" and e.get("cat") in DEVICE), key=start
        )
        episodes = split(events)
        print(f"== {path}: {len(episodes)} episodes")
        for k, ep in enumerate(episodes):
            describe(k, ep)


if __name__ == "__main__":
    main()
