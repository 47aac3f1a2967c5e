"""A byte-level BPE tokenizer of a realistic vocabulary size (128,000 by default, Llama 3's order), trained
on the Python sources installed on this machine, so structured output's token masks cost what they would
with a real model's tokenizer. Its special tokens are the synthetic models' (ids 0 and 1: BOS, EOS), so
it can replace a `tools/make_tiny_model` checkpoint's tokenizer.json when the checkpoint's vocab_size
(128,256 for the 1b and 8b presets) holds it.

    python -m benchmarks.bpe_tokenizer OUT_DIR [--vocab 128000] [--files 20000]"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from runtime.synthetic.model import BOS, EOS


def train(out_dir: Path, vocab: int = 128_000, max_files: int = 20_000) -> int:
    """Write OUT_DIR/tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    paths = sysconfig.get_paths()
    roots = sorted({Path(paths["stdlib"]), Path(paths["purelib"])})
    files = sorted(str(p) for root in roots for p in root.rglob("*.py") if p.is_file())[:max_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok.get_vocab_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128_000)
    ap.add_argument("--files", type=int, default=20_000)
    args = ap.parse_args()
    print(f"{train(args.out, args.vocab, args.files)} tokens in {args.out / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
