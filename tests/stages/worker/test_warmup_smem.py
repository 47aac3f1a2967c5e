"""Every kernel variant of the warm-up plan fits a Hopper GPU's shared memory: the plan's LoRA and
attention launches are recorded on the CPU for sm_90 (`smem_scenario.py`, in a fresh process: this
session runs Triton's interpreter) and compiled there; Triton reads each compiled kernel's shared memory
from its own allocation, and the GPU refuses to load one that needs more than one program may have.

Bound: of the variants that differ only in tile sizes, those of the largest tiles are compiled
(`smem_scenario.largest_tiles`; all of them: `python tests/stages/worker/smem_scenario.py OUT 90 132
CASES all`), so that the test stays well under a minute on two cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import triton

from kernels.device_info import HOPPER_MAX_SHARED
from tests.kernels.compile_child import run_compiled

SCENARIO = Path(__file__).with_name("smem_scenario.py")
H100_SMS = 132
# float32 and bf16 tiny llama, max rank 64 and 16, the whole model's shapes and a TP=2 rank's shard
CASES = [
    {"dtype": "float32", "max_rank": 64, "tp": 2},
    {"dtype": "float32", "max_rank": 16, "tp": 1},
    {"dtype": "bfloat16", "max_rank": 64, "tp": 1},
    {"dtype": "bfloat16", "max_rank": 16, "tp": 2},
]
KERNELS = {"_lora_shrink_kernel", "_lora_expand_kernel", "_lora_expand_act_kernel", "_paged_attention_kernel"}


def _cuda_compiler() -> bool:
    """Triton's CUDA backend and its ptxas are installed (no GPU is needed to compile for one)."""
    if "nvidia" not in triton.backends.backends:
        return False
    try:
        return Path(triton.knobs.nvidia.ptxas.path).is_file()
    except RuntimeError:
        return False


@pytest.mark.skipif(not _cuda_compiler(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_every_warm_up_variant_fits_hopper_shared_memory(tmp_path):
    out = tmp_path / "variants.json"
    cache = {"TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run_compiled(SCENARIO, str(out), "90", str(H100_SMS), json.dumps(CASES), timeout=300, env=cache)
    result = json.loads(out.read_text())
    variants = result["variants"]
    for dtype in ("float32", "bfloat16"):  # the plan was recorded and compiled for each data type
        assert KERNELS <= {v["name"] for v in variants if v["case"]["dtype"] == dtype}, dtype
    assert result["distinct"] >= len(variants) > 0
    too_big = [
        f"{v['name']} {v['case']} {v['constants']} num_warps={v['num_warps']} num_stages={v['num_stages']}: "
        f"{v['shared']} bytes"
        for v in variants
        if v["shared"] > HOPPER_MAX_SHARED
    ]
    assert not too_big, f"over {HOPPER_MAX_SHARED} bytes of shared memory:\n" + "\n".join(too_big)
