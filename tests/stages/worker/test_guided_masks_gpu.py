"""On a GPU: grammar masks copied to the device on their own stream and unpacked there equal llguidance's
byte-per-token masks, step after step, while the default stream is kept busy (the copy must still land
before the unpack reads it) and the pinned buffers of earlier steps are reused. Runs only with CUDA."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from proto.sampling import Guided
from runtime.common.grammar import grammar_of, matcher_tokenizer
from stages.worker.guided import GuidedMasks
from tests.stages.worker.test_guided_masks import REGEX, SCHEMA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_masks_on_the_device_follow_llguidance(tiny_llama):
    vocab, width, eos = 384, 400, [1]
    tok = matcher_tokenizer((tiny_llama / "tokenizer.json").read_text(), vocab, eos)
    device = torch.device("cuda")
    masks = GuidedMasks(str(tiny_llama), vocab, eos, device)
    grammars = [Guided("json", json.dumps(SCHEMA)), Guided("regex", REGEX)] * 8
    texts = ['{"answer":"no","n":42}', "abcab-123"] * 8
    refs = []
    try:
        for i, g in enumerate(grammars):
            masks.add(f"r{i}", g)
            refs.append(llguidance.LLMatcher(tok, grammar_of(g)))
        ids = [f"r{i}" for i in range(len(grammars))]
        tokens = [tok.tokenize_str(t) for t in texts]
        fed = [0] * len(ids)
        busy = torch.randn(4096, 4096, device=device)
        for step in range(max(map(len, tokens))):
            for _ in range(4):  # keep the default stream busy while the copy is issued
                busy = torch.tanh(busy @ busy * 1e-3)
            job = masks.start(ids, background=step % 2 == 0)
            got = job.result(width).cpu()
            assert job.failed == {}
            for j, ref in enumerate(refs):
                want = torch.frombuffer(bytearray(ref.compute_logit_bias()), dtype=torch.uint8) > 0
                assert torch.equal(got[j, :vocab], want) and not got[j, vocab:].any(), (step, j)
            for j, toks in enumerate(tokens):
                if fed[j] < len(toks):
                    assert refs[j].consume_token(toks[fed[j]])
                    fed[j] += 1
            masks.feed([(rid, toks, 0, n) for rid, toks, n in zip(ids, tokens, fed, strict=True)])
    finally:
        masks.close()
