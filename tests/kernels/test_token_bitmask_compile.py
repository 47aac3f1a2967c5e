"""The grammar-mask kernel compiles for sm_90 without a GPU (`triton.compile` with a `GPUTarget`) on the
operands sampling passes (float32 logits, int64 rows, int32 words): code the CPU interpreter accepts and
the compiler refuses fails here, not first on the GPU machine. Runs in a child process (see
compile_child.py)."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import token_bitmask
from tests.kernels.compile_child import run_compiled


def check_compiles() -> None:
    fn = token_bitmask._masked_logits_kernel
    pointers = {"logits_ptr": "*fp32", "rows_ptr": "*i64", "words_ptr": "*i32", "out_ptr": "*fp32"}
    consts = {"BLOCK": token_bitmask.BLOCK}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    assert compiled.asm["cubin"]
    print("ok")


@pytest.mark.timeout(300)
def test_kernel_compiles_for_sm90():
    assert run_compiled(__file__) == ["ok"]


if __name__ == "__main__":
    check_compiles()
