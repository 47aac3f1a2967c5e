"""The `lorapipe` command line: `lorapipe demo` runs a mixed-adapter batch on an embedded tiny model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorapipe", description="Serve one base LLM with many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate a tiny model and adapters, run a mixed-adapter batch")
    demo.add_argument("--dir", type=Path, default=Path(".cache/lorapipe-demo"), help="where the demo files live")
    demo.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from runtime.demo import run_demo

        return run_demo(args.dir, args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
