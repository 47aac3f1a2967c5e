"""The fold kernels (kernels/lora_fold_*.py) compile for sm_90 without a GPU (`triton.compile` with a
`GPUTarget`), in the variants a decode step launches (dependent launch on; bf16 rows of rank tile 16;
e4m3 rows of rank tile 128: a norm with both folds, whose row chunks are a loop, and the activation):
code the CPU interpreter accepts and the compiler refuses (one name of two types in the branches of an
`if`) fails here, not first on the GPU machine. In a child process, as
tests/kernels/test_lora_fp8_compile.py explains."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import lora_fold_act, lora_fold_norm, lora_fold_rope
from kernels.batch_info import META_COLS
from tests.kernels.compile_child import run_compiled

TARGET = GPUTarget("cuda", 90, 32)
FP32 = {"inv_ptr", "ve_ptr", "vs_ptr", "v_ptr", "vd_ptr", "se_ptr", "scal_ptr", "eps"}
INT32 = {"re_ptr", "rs_ptr", "rd_ptr", "ranks_ptr", "rows_ptr", "meta_ptr"}
MODEL = {"h_ptr", "d_ptr", "w_ptr", "sum_ptr", "x_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr"}
MODEL |= {"k_cache_ptr", "v_cache_ptr", "gu_ptr", "act_ptr"}


def _compile(fn, row: str, consts: dict) -> None:
    scaled = any(consts.get(k) for k in ("SCALED", "SCALED_E", "SCALED_S"))

    def kind(name: str) -> str:
        if name in consts:
            return "constexpr"
        if name == "eps":
            return "fp32"
        if name in ("a_ptr", "be_ptr", "b_ptr"):
            return "*" + row
        if name in ("as_ptr", "bes_ptr", "bs_ptr"):
            return "*fp32" if scaled else "*" + row
        if name == "kvrows_ptr":
            return "*i64"
        if name.endswith("_ptr"):
            return "*fp32" if name in FP32 else "*i32" if name in INT32 else "*bf16"
        return "i32"

    signature = {n: kind(n) for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=TARGET)


def check_variants(row: str, br: int) -> None:
    scaled = row != "bf16"
    common = dict(BLOCK_R=br, META=META_COLS, PDL=True)
    norms = (
        ((False, False, True), (True, True, True), (True, True, False)) if br == 16 else ((True, True, True),)
    )
    for add, ex, sh in norms:
        consts = dict(common, ADD=add, EXPAND=ex, SHRINK=sh, PE=28 if ex else 1, NUM_SLICES=3 if sh else 1)
        consts.update(BLOCK_C=8192 // br if ex else 4096, NCH=br // 2 if ex else 1, BLOCK_T=64, BLOCK_M=16)
        consts.update(UNROLL=consts["NCH"] <= lora_fold_norm.MAX_UNROLL)
        consts.update(BLOCK_N=64, BLOCK_K=lora_fold_norm.SHRINK_K, SPLITS=16, UPCAST=False)
        _compile(lora_fold_norm._fold_norm_kernel, row, dict(consts, SCALED_E=ex and scaled, SCALED_S=scaled))
    if br == 16:  # the rotary of a wide rank tile differs in sizes alone
        rope = dict(common, NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_D=64, BLOCK_M=16)
        rope.update(BLOCK_T=64, UPCAST=False)
        _compile(lora_fold_rope._fold_rope_kernel, row, dict(rope, SPLITS=16, SCALED=scaled))
    act = dict(common, BLOCK_M=16, BLOCK_N=128 if br <= 32 else 64, NB=4, BLOCK_T=64, SPLITS=16)
    _compile(lora_fold_act._fold_act_kernel, row, dict(act, SHRINK=True, UPCAST=False, SCALED=scaled))


@pytest.mark.timeout(300)
def test_fold_kernels_compile_for_sm90():
    assert run_compiled(__file__) == ["bf16:16", "fp8e4nv:128"]


if __name__ == "__main__":
    for row, br in (("bf16", 16), ("fp8e4nv", 128)):
        check_variants(row, br)
        print(f"{row}:{br}")
