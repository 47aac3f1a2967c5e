"""No eager serving step needs a LoRA kernel specialization that the warm-up did not make, checked on the
CPU for a Hopper GPU: `serving_specs_scenario.py` records, for sm_90 (in a fresh process: this session
runs Triton's interpreter, which specialises nothing), what the warm-up plan's launches and what the
real runner's eager steps over a sweep of batches ask Triton for, in the configuration of
test_warmup_gpu.py. The plan is made of kernel configs; Triton also specialises on integer arguments
(1, multiples of 16) and pointer alignment, which a config does not name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import triton

from tests.kernels.compile_child import run_compiled

SCENARIO = Path(__file__).with_name("serving_specs_scenario.py")
LORA_KERNELS = ["_lora_expand_act_kernel", "_lora_expand_kernel", "_lora_shrink_kernel"]
DEVICES = ["hopper", "default"]  # an H100's or H200's device facts; the CPU's


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """One child process records both devices (its imports take a third of its time)."""
    tmp = tmp_path_factory.mktemp("specs")
    run_compiled(SCENARIO, str(tmp / "specs.json"), str(tmp), *DEVICES, timeout=240)
    return json.loads((tmp / "specs.json").read_text())


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton's CUDA backend is not installed")
@pytest.mark.parametrize("device", DEVICES)
def test_eager_steps_need_no_specialization_the_warm_up_did_not_make(recorded, device):
    result = recorded[device]
    assert result["served"] == LORA_KERNELS and result["steps"] > 200 and result["planned"] > 0
    missing = [
        f"{spec}\n    needed by steps of {sorted(set(t))[:12]} tokens"
        for spec, t in result["missing"].items()
    ]
    assert not missing, f"{len(missing)} specializations not made by the warm-up:\n" + "\n".join(missing)
