"""`lorapipe serve` flags of the base model (the "model" help group): the checkpoint, the device, its
dtype and quantization, and tensor parallelism."""

from __future__ import annotations

import argparse

from runtime.common.quant_config import QUANTIZATIONS
from runtime.engine_args import EngineArgs

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_arguments(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The base model, where and how it runs: checkpoint, device, dtype, quantization, sharding."""
    g.add_argument(
        "--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory of the base model"
    )
    g.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="where to run (default: cuda if available)"
    )
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="serving dtype (auto: the checkpoint's)")
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=d.quantization,
        help="fp8: the base model's linear layers in fp8 e4m3, one scale per output channel, a bf16 "
        "checkpoint quantized at load (default: as the checkpoint stores them; fp8 ones run in fp8)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        default=d.tensor_parallel_size,
        help="shard the model and every adapter over N GPUs (cuda:0..N-1; N processes on cpu), one "
        "worker process each",
    )
    g.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        default=d.disable_custom_all_reduce,
        help="tensor parallel: sum every message through NCCL, not small ones through NVLink peer memory",
    )
    g.add_argument("--seed", type=int, metavar="N", default=d.seed, help="seed of requests that set none")
