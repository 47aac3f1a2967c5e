"""The prefix cache's keys: one chain hash per full page of a prompt. A page's KV depends on the adapter
(LoRA changes K and V), on the weights that adapter was loaded with, and on every token before the page's
end, so the chain starts from the adapter's name and load generation (base-only requests have a key of
their own) and each page's hash covers the one before it and the page's tokens."""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16  # 128-bit BLAKE2b: a collision between two different prefixes is not a concern


def adapter_key(adapter: str | None, generation: int) -> bytes:
    """The chain's root: `adapter` at its load `generation` (an unload or a replacement makes a new
    one), or the base model. Length-prefixed, so no name can spell another's key."""
    if adapter is None:
        return b"base"
    name = adapter.encode()
    return b"lora:%d:%s:%d" % (len(name), name, generation)


def page_hashes(root: bytes, token_ids: list[int], page_size: int) -> list[bytes]:
    """The chain hash of each full page of `token_ids` (a trailing partial page has none)."""
    out = []
    prev = hashlib.blake2b(root, digest_size=DIGEST_BYTES).digest()
    data, step = array("q", token_ids).tobytes(), 8 * page_size  # 8 bytes a token
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[start : start + step], digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out
