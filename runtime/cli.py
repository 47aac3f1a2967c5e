"""The `lorapipe` command line: `lorapipe serve` runs the multi-process pipeline under the launcher;
`lorapipe warmup` fills the compile cache for the same arguments; `lorapipe demo` makes a tiny model and
adapters, serves them and streams a mixed-adapter workload."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.base.prestart import PrestartedWorker


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    device, prestarted = None, None
    if words[:1] in (["serve"], ["warmup"]):
        from runtime.base.prestart import PrestartedWorker, device_hint

        device = device_hint(words[1:])
    if words[:1] == ["serve"]:
        # the worker's interpreter and imports (seconds) run beside everything below: the launcher hands
        # it its config once written (runtime/base/prestart.py), or kills it if the start-up ends first
        prestarted = PrestartedWorker(device)
    try:
        return _main(words, device, prestarted)
    finally:
        if prestarted is not None and not prestarted.adopted:
            prestarted.kill()


def _main(words: list[str], device: str | None, prestarted: PrestartedWorker | None) -> int:
    if device not in (None, "cpu"):
        # the CUDA driver's initialisation, which the argument checks ask for (--device, fp8, TP), runs
        # beside the imports and parsing below rather than after them: the stages spawn that much sooner
        from runtime.common.cuda_driver import start_driver

        start_driver()
    from runtime.serve_args import (
        ArgumentParser,
        HelpFormatter,
        ServeArgsError,
        add_serve_arguments,
        from_namespace,
    )
    from runtime.serve_checks import validate

    parser = ArgumentParser(prog="lorapipe", description="Serve one base LLM with many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model and its adapters (tokenizer, scheduler, loader, worker)",
        description="Serve one base model and many LoRA adapters. Start-up errors print one line and "
        "exit with status 2; a stage failing later exits with status 1.",
        formatter_class=HelpFormatter,
    )
    add_serve_arguments(serve)
    warmup = sub.add_parser(
        "warmup",
        help="fill the compile cache for `serve` with the same arguments (image build, init container)",
        description="Compile every kernel a server started with the same arguments will run, into its "
        "compile cache (--compile-cache-dir), on this machine's GPU, then exit.",
        formatter_class=HelpFormatter,
    )
    add_serve_arguments(warmup)
    demo = sub.add_parser(
        "demo",
        help="make a tiny model and adapters, serve them, stream mixed requests",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--dir", type=Path, default=Path(".cache/lorapipe-demo"), help="demo files live here")
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the demo runs")
    demo.add_argument("--max-tokens", type=int, default=12, help="tokens each request generates")
    args, extra = parser.parse_known_args(words)
    if extra:  # told by the subcommand, whose flags they were meant to be
        command = {"serve": serve, "warmup": warmup, "demo": demo}[args.command]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("serve", "warmup"):
        try:
            serve_args = from_namespace(args)
            model_cfg = validate(serve_args)
        except ServeArgsError as exc:
            print(f"lorapipe {args.command}: error: {exc}", file=sys.stderr)  # one line; no usage block
            sys.exit(2)
        if args.command == "warmup":
            from runtime.warmup_cli import run_warmup

            return run_warmup(serve_args, model_cfg)
        from runtime.launcher import run_server

        return run_server(serve_args, model_cfg=model_cfg, prestarted=prestarted)
    if args.command == "demo":
        from runtime.demo import run_demo

        return run_demo(args.dir, args.device, max_tokens=args.max_tokens)
    return 2


if __name__ == "__main__":
    sys.exit(main())
