"""`python -m runtime.ray_serve [flags] -- [lorapipe serve flags]`: start (or join, --address) a Ray
cluster, run the lorapipe application behind Ray Serve's HTTP proxy on --host/--port, and stay up until
SIGINT/SIGTERM, which shut the application down (each replica drains its server)."""

from __future__ import annotations

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    from runtime.ray_serve.config import ClusterConfigError, build_parser, from_args

    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = from_args(ns)
    except ClusterConfigError as exc:
        print(f"python -m runtime.ray_serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("python -m runtime.ray_serve: needs Ray Serve: pip install 'lorapipe[ray]'", file=sys.stderr)
        return 2
    from runtime.ray_serve.app import build_app

    ray.init(address=ns.address)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix="/")
    print(f"lorapipe on Ray Serve: http://{cfg.host}:{cfg.port}/v1 ({cfg.num_replicas} replicas)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(cfg.app_name)
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
