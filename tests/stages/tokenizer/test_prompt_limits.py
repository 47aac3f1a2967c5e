"""The checks made before tokenizing: the derived byte limit is a true bound (no prompt over it fits
the context, so refusing it never refuses a prompt that fits), sizes are checked without tokenizing,
and adapter ops are checked for runtime loading, names and the adapter root."""

from __future__ import annotations

import asyncio
import functools
import os
import random

import pytest

from proto.base import TokenIds
from proto.client import GenerateRequest, LoadAdapter, UnloadAdapter
from proto.sampling import SamplingParams
from runtime.synthetic.model import make_model
from stages.tokenizer.adapter_ops import check_adapter_op, confine, path_refused
from stages.tokenizer.validate import Rejected, check_prompt_size, encode_prompt, prompt_byte_limit


@pytest.fixture(scope="module")
def real_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    model = make_model(tmp_path_factory.mktemp("m") / "m", arch="llama", preset="tiny", seed=1)
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def test_byte_limit_bounds_the_token_count(real_tokenizer):
    """Every token spans at most `longest` bytes, so tokens >= bytes / longest: the premise of the
    derived limit, checked on adversarial texts (the longest entries repeated, random Unicode)."""
    vocab = real_tokenizer.get_vocab()
    longest = max(len(t.encode()) for t in vocab)
    rng = random.Random(3)
    texts = [
        "".join(rng.choice(sorted(vocab, key=len)[-20:]) for _ in range(200)),
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(2000)),
        " " * 5000,
        "The river ran slowly past the old mill. " * 100,
    ]
    for text in texts:
        ids = encode_prompt(GenerateRequest(request_id="r", prompt=text), real_tokenizer)
        assert len(ids) * longest >= len(text.encode()), text[:40]
    assert prompt_byte_limit(real_tokenizer, 512) == 512 * max(longest, 4)
    assert prompt_byte_limit(real_tokenizer, 512, configured=1000) == 1000


def test_sizes_are_checked_before_tokenizing():
    p = SamplingParams(max_tokens=4)
    ok = GenerateRequest(request_id="r", prompt="é" * 100, sampling=p)
    check_prompt_size(ok, max_prompt_bytes=200, max_model_len=64)
    with pytest.raises(Rejected, match="201 bytes"):  # 100 chars, but 200 bytes + 1
        check_prompt_size(
            GenerateRequest(request_id="r", prompt="é" * 100 + "x", sampling=p),
            max_prompt_bytes=200,
            max_model_len=64,
        )
    with pytest.raises(Rejected, match="exceeds the model's context"):
        ids = GenerateRequest(request_id="r", prompt_ids=TokenIds.of(range(61)), sampling=p)
        check_prompt_size(ids, max_prompt_bytes=200, max_model_len=64)


def test_adapter_ops_checks(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "out").symlink_to(tmp_path)
    real = os.path.realpath(root)
    load = LoadAdapter(request_id="r", name="x", path="a")
    ops = functools.partial(check_adapter_op, runtime_loading=True, allow_any_path=False)
    assert ops(load, adapter_root=real) == os.path.join(real, "a")
    unconfined = ops(load, adapter_root=None, allow_any_path=True)
    assert unconfined == "a"  # as given, only when the server opted in
    with pytest.raises(Rejected) as info:
        ops(load, runtime_loading=False, adapter_root=None)
    assert info.value.kind == "forbidden"
    with pytest.raises(Rejected) as info:
        ops(UnloadAdapter(request_id="r", name="x"), runtime_loading=False, adapter_root=None)
    assert info.value.kind == "forbidden"
    # outside the root, or no root and no opt-in: one text, whatever exists on disk
    texts = set()
    for path, root_ in [(p, real) for p in ("out", "out/a", "../root/../x", "/etc", "/does/not/exist")] + [
        (p, None) for p in ("a", "/etc", "/does/not/exist", str(root / "a"))
    ]:
        if root_ is not None:
            assert confine(path, root_) is None, path
        with pytest.raises(Rejected, match="adapter root") as info:
            ops(LoadAdapter(request_id="r", name="x", path=path), adapter_root=root_)
        assert info.value.kind == "forbidden"
        texts.add(info.value.message)
    assert texts == {path_refused("x")}
    for name in ("", "../x", "a\n", "x" * 129, ".hidden"):
        with pytest.raises(Rejected, match="adapter name") as info:
            ops(LoadAdapter(request_id="r", name=name, path="a"), adapter_root=real)
        assert info.value.kind == "invalid_request"


def test_apart_tokenizer_budget_abort_and_drain(real_tokenizer):
    from stages.tokenizer.tokenizing import ApartTokenizer

    admitted, refused = [], []

    async def admit(identity, msg, ids):
        admitted.append((identity, msg.request_id, ids))

    async def refuse(identity, rid, exc):
        refused.append((identity, rid, exc.kind))

    def req(rid: str, text: str) -> GenerateRequest:
        return GenerateRequest(request_id=rid, prompt=text)

    async def main():
        apart = ApartTokenizer(real_tokenizer, 1, 100, admit, refuse)
        apart.start(b"c1", req("big", "x" * 101))  # over the byte budget: refused, never pending
        apart.start(b"c1", req("a", "The river " * 5))
        apart.start(b"c2", req("b", "Stories " * 5))
        assert "big" not in apart and len(apart) == 2
        assert not apart.cancel("b", b"c1")  # only its own client may abort it
        assert apart.cancel("b", b"c2")
        while apart:  # "a" is admitted once its thread is done
            await asyncio.sleep(0.01)
        apart.start(b"c3", req("c", "Once " * 5))
        assert apart.drain() == [("c", b"c3")] and not apart
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert refused == [(b"c1", "big", "server_error")]
    assert [(i, r) for i, r, _ in admitted] == [(b"c1", "a")]
    assert admitted[0][2] == real_tokenizer.encode("The river " * 5).ids
