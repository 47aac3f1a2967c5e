"""Adapter operations on a running `lorapipe serve` through the client SDK: `load NAME=PATH...` registers
adapters (the server validates and stages each into its host cache; sent at once, so the loader's
threads read them in parallel), `unload NAME...` (returns once they are gone), and `list` (one table:
tier, slot, state, rank).
    python -m tools.adapter_ops --endpoint tcp://127.0.0.1:7450 load a=/path/a b=/path/b"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from runtime.client import DEFAULT_ENDPOINT, AsyncClient
from runtime.serve_args import ServeArgsError, parse_adapter


async def load(endpoint: str, specs: Sequence[tuple[str, str]], timeout: float) -> None:
    async with AsyncClient(endpoint, timeout=timeout) as c:
        await asyncio.gather(*(c.load_adapter(name, path) for name, path in specs))


async def unload(endpoint: str, names: Sequence[str], timeout: float) -> None:
    """Returns once the server lists none of `names` (it removes an adapter, and frees its slot and host
    block, only when no request uses it), so the same names can be loaded again right after."""
    async with AsyncClient(endpoint, timeout=timeout) as c:
        await asyncio.gather(*(c.unload_adapter(name) for name in names))
        deadline = asyncio.get_running_loop().time() + timeout
        while left := set(names) & {e.name for e in await c.list_adapters()}:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"still listed {timeout} s after unloading: {sorted(left)}")
            await asyncio.sleep(0.05)


async def listing(endpoint: str, timeout: float) -> str:
    async with AsyncClient(endpoint, timeout=timeout) as c:
        entries = await c.list_adapters()
    lines = [f"{'adapter':<24} {'tier':<8} {'slot':>4} {'state':<10} {'rank':>4}"]
    for e in sorted(entries, key=lambda e: e.name):
        slot = "-" if e.slot is None else str(e.slot)
        lines.append(f"{e.name:<24} {e.tier:<8} {slot:>4} {e.state:<10} {e.rank:>4}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.adapter_ops", description=__doc__)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the server's client endpoint")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per reply wait")
    sub = p.add_subparsers(dest="op", required=True)
    sub.add_parser("load", help="register adapters").add_argument("specs", nargs="+", metavar="NAME=PATH")
    sub.add_parser("unload", help="remove adapters").add_argument("names", nargs="+", metavar="NAME")
    sub.add_parser("list", help="print every registered adapter")
    ns = p.parse_args(argv)
    if ns.op == "load":
        try:
            specs = [parse_adapter(s) for s in ns.specs]
        except ServeArgsError as exc:
            p.error(str(exc))
        asyncio.run(load(ns.endpoint, specs, ns.timeout))
        print(f"loaded {len(specs)} adapters: {', '.join(n for n, _ in specs)}")
    elif ns.op == "unload":
        asyncio.run(unload(ns.endpoint, ns.names, ns.timeout))
        print(f"unloaded {len(ns.names)} adapters")
    else:
        print(asyncio.run(listing(ns.endpoint, ns.timeout)))


if __name__ == "__main__":
    main()
