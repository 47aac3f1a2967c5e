"""The weight-only fp8 GEMM compiles for sm_90 without a GPU (`triton.compile` with a `GPUTarget`), every
variant the warm-up plans for the 8B shapes (and the fix-up and bias variants): code the CPU interpreter
accepts and the compiler refuses (inline assembly, a global that is not a constexpr, the atomics) fails
here, not first on the GPU machine. The bit-move widening emits its prmt/fma sequence and no conversion
instruction; Triton's conversion emits no bf16 fma; the w8a8 variant multiplies e4m3 by e4m3. The
checks run in a child process: this directory's conftest makes kernels interpreted in the tests' own
process, and an interpreted kernel cannot be compiled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import fp8_gemm
from tests.kernels.compile_child import run_compiled

TARGET = GPUTarget("cuda", 90, 32)
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def _compile(cfg: fp8_gemm.GemmConfig, split: bool, bias: bool, act: str = "bf16"):
    consts = dict(HAS_BIAS=bias, SPLIT_K=split, EVEN_K=True, BITS=cfg.bits, A8=cfg.a8, UPCAST=False,
                  FMAX=448.0, MIN_AMAX=1e-12, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k)  # fmt: skip
    pointers = {"x_ptr": act, "w_ptr": "fp8e4nv", "s_ptr": "fp32", "b_ptr": act, "out_ptr": act,
                "part_ptr": "fp32", "cnt_ptr": "i32"}  # fmt: skip
    fn = fp8_gemm._w8a16_kernel
    signature = {
        n: "constexpr" if n in consts else ("*" + pointers[n] if n in pointers else "i32")
        for n in fn.arg_names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(
        src, target=TARGET, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    )


def check_variants_compile() -> None:
    every = fp8_gemm.configs_for(SHAPES_8B, 132, fp8_gemm.TILE_MAX_M)  # each tile, not only those served
    tiles = {replace(cfg, split=1) for cfg in every}  # the split count is not compiled in
    for cfg in sorted(tiles, key=lambda c: c.block_m):
        for bits in (True, False):
            for split in (False, True):
                ptx = _compile(replace(cfg, bits=bits), split, split).asm["ptx"]
                assert ("prmt.b32" in ptx and "fma.rn.bf16x2" in ptx) == bits, (cfg, bits)
                assert ("cvt.rn.f16x2.e4m3x2" in ptx) != bits, (cfg, bits)
                assert ("atom.global.gpu.acq_rel.add" in ptx) == split
            # the w8a8 variant: the codes go to the fp8 tensor cores as they are, x quantized in the kernel
            ptx = _compile(replace(cfg, bits=bits, a8=True), True, False).asm["ptx"]
            assert "e4m3.e4m3" in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx and "fma.rn.bf16x2" not in ptx
        print(cfg.block_m)
    _compile(fp8_gemm.choose_config(16, 4096, 4096, 132), True, True, "fp16")  # float16 activations
    print("fp16")


@pytest.mark.timeout(300)
def test_variants_compile_for_sm90():
    assert run_compiled(__file__) == ["16", "32", "64", "fp16"]


if __name__ == "__main__":
    check_variants_compile()
