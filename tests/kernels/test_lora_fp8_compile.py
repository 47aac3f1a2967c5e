"""The 8-bit kernel variants compile for sm_90 without a GPU (`triton.compile` with a `GPUTarget`): code
the CPU interpreter accepts and the compiler refuses (a helper returning two types, a global that is not
a constexpr) fails here, not first on the GPU machine; and without SCALED the 8-bit code is not emitted.
The checks run in a child process: this directory's conftest makes kernels interpreted in the tests'
own process, and an interpreted kernel cannot be compiled."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import lora_expand, lora_expand_act, lora_quant, lora_shrink
from kernels.batch_info import META_COLS
from tests.kernels.compile_child import run_compiled

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {  # element type of each pointer argument; a row pointer and its scales take the row type
    "x_ptr": "bf16", "v_ptr": "fp32", "p_ptr": "fp32", "sem_ptr": "i32", "ranks_ptr": "i32",
    "rows_ptr": "i32", "meta_ptr": "i32", "out_ptr": "bf16", "scal_ptr": "fp32", "gu_ptr": "bf16",
    "act_ptr": "bf16", "src_ptr": "bf16", "scale_ptr": "fp32", "seg_ptr": "i32",
}  # fmt: skip
SHRINK = dict(NUM_SLICES=3, BLOCK_R=16, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, REDUCE_SPLITS=4, UPCAST=False)
EXPAND = dict(NUM_SLICES=3, NUM_SPLITS=2, BLOCK_R=64, BLOCK_M=16, BLOCK_N=128, BLOCK_K=16, UPCAST=False)
EXPAND.update(SKIP_UNIFORM=False, ACT_BM=16)
ACT = dict(NUM_SPLITS=1, BLOCK_R=32, BLOCK_M=16, BLOCK_N=128, BLOCK_K=32, UPCAST=False)


def _compile(fn, row: str, consts: dict):
    scale = "fp32" if consts.get("SCALED") else row
    pointers = {**POINTERS, "a_ptr": row, "b_ptr": row, "dst_ptr": row, "as_ptr": scale, "bs_ptr": scale}
    signature = {
        n: "constexpr" if n in consts else ("*" + pointers[n] if n in pointers else "i32")
        for n in fn.arg_names
    }
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=TARGET)


def _instructions(kernel) -> int:
    lines = (line.strip() for line in kernel.asm["ptx"].splitlines())
    return sum(
        1 for x in lines if x and not x.startswith((".", "//", "{", "}", "(", ")")) and not x.endswith(":")
    )


KERNELS = [
    (lora_shrink._lora_shrink_kernel, SHRINK),
    (lora_expand._lora_expand_kernel, EXPAND),
    (lora_expand_act._lora_expand_act_kernel, ACT),
]


def check_8bit_variants_compile(row: str) -> None:
    for fn, consts in KERNELS:
        _compile(fn, row, dict(consts, META=META_COLS, PDL=True, SCALED=True))
    qmax = lora_quant.QMAX[lora_quant.QUANT_DTYPES["fp8" if row == "fp8e4nv" else "int8"]]
    _compile(lora_quant._quantize_rows_kernel, row, dict(BLOCK=1024, QMAX_=qmax, INT=row == "i8"))


def check_model_dtype_variant_pays_nothing() -> None:
    """bf16 rows without SCALED compile to fewer instructions than the 8-bit variant (the scale loads and
    conversions are not emitted)."""
    for fn, consts in KERNELS:
        plain = _instructions(_compile(fn, "bf16", dict(consts, META=META_COLS, PDL=True, SCALED=False)))
        scaled = _instructions(_compile(fn, "fp8e4nv", dict(consts, META=META_COLS, PDL=True, SCALED=True)))
        assert plain < scaled, (fn.__name__, plain, scaled)


@pytest.mark.timeout(300)
def test_8bit_variants_compile_for_sm90():
    assert run_compiled(__file__) == ["fp8e4nv", "i8", "bf16"]


if __name__ == "__main__":
    for row in ("fp8e4nv", "i8"):
        check_8bit_variants_compile(row)
        print(row)
    check_model_dtype_variant_pays_nothing()
    print("bf16")
