"""A byte-level BPE tokenizer of a realistic vocabulary size (128,000 by default, Llama 3's order), trained
on the Python sources installed on this machine, so structured output's token masks cost what they would
with a real model's tokenizer. Its special tokens are the synthetic models' (ids 0 and 1: BOS, EOS), so
it can replace a `tools/make_tiny_model` checkpoint's tokenizer.json when the checkpoint's vocab_size
(128,256 for the 1b and 8b presets) holds it.

    python -m benchmarks.bpe_tokenizer OUT_DIR [--vocab 128000] [--max-mb 32]"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from runtime.synthetic.model import BOS, EOS

MAX_TOKEN_BYTES = 64  # characters of the byte-level alphabet: one byte each


def sources(max_bytes: int) -> Iterator[str]:
    """The installed Python sources, standard library first, up to about `max_bytes` of UTF-8 text (a
    file that is not valid UTF-8, as some of the library's own tests are, is skipped)."""
    paths = sysconfig.get_paths()
    seen = 0
    for root in dict.fromkeys((Path(paths["stdlib"]), Path(paths["purelib"]))):
        for path in sorted(root.rglob("*.py")):
            try:
                text = path.read_bytes().decode()
            except (OSError, UnicodeDecodeError):
                continue
            yield text
            seen += len(text)
            if seen >= max_bytes:
                return


def train(out_dir: Path, vocab: int = 128_000, max_mb: int = 32) -> int:
    """Write OUT_DIR/tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        # Real vocabularies hold no token of hundreds of bytes; the installed sources may (a long literal
        # of one character), and llguidance refuses a token of more than 1,024 bytes.
        max_token_length=MAX_TOKEN_BYTES,
    )
    tok.train_from_iterator(sources(max_mb << 20), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok.get_vocab_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128_000)
    ap.add_argument("--max-mb", type=int, default=32, help="megabytes of source text to train on")
    args = ap.parse_args()
    print(f"{train(args.out, args.vocab, args.max_mb)} tokens in {args.out / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
