"""The fused top-k log-probability kernels compile for sm_90 without a GPU (`triton.compile` with a
`GPUTarget`), on float32 logits (what sampling passes) and bf16: code the CPU interpreter accepts and the
compiler refuses (a global that is not a constexpr, a loop-carried value whose type changes, the while
loop of the running top-k set) fails here, not first on the GPU machine. Runs in a child process (see
compile_child.py)."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import top_logprobs
from tests.kernels.compile_child import run_compiled

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, pointers: dict[str, str], consts: dict, num_warps: int):
    signature = {
        n: "constexpr" if n in consts else ("*" + pointers[n] if n in pointers else "i32")
        for n in fn.arg_names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps))


def check_compiles() -> None:
    for dtype in ("fp32", "bf16"):
        chunk = _compile(
            top_logprobs._chunk_kernel,
            {"logits_ptr": dtype, "rows_ptr": "i64", "ms_ptr": "fp32", "keys_ptr": "i64"},
            dict(BLOCK=top_logprobs.BLOCK, KP=top_logprobs.KP),
            8,
        )
        merge = _compile(
            top_logprobs._merge_kernel,
            {"logits_ptr": dtype, "rows_ptr": "i64", "tokens_ptr": "i64", "ms_ptr": "fp32", "keys_ptr": "i64",
             "out_ptr": "i32"},
            dict(SB=top_logprobs.MAX_SPLITS, KP=top_logprobs.KP),
            4,
        )  # fmt: skip
        assert chunk.asm["cubin"] and merge.asm["cubin"]
        print(dtype)


@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90():
    assert run_compiled(__file__) == ["fp32", "bf16"]


if __name__ == "__main__":
    check_compiles()
