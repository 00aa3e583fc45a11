"""Train the `tiny:qwen2_gsm8k` preset's byte-level BPE tokenizer on GSM8K's training text.

The trained file ships in this package (:data:`nebula_rl.models.GSM8K_TOKENIZER_FILE`), so the
preset needs neither the dataset nor training at run time. Training is deterministic (the same
file on every run, whatever the process's hash seeds), and `tests/test_bench_gsm8k.py` checks
that it reproduces the shipped copy. Rebuild or check it from the repository root:

    python -m nebula_rl.models.bpe [--data data/gsm8k/train.jsonl] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from nebula_rl.models import GSM8K_TOKENIZER_FILE, SPECIAL_TOKENS

GSM8K_VOCAB_SIZE = 4096
"""Tokens in the GSM8K tokenizer: the special tokens, the 256 bytes and the merges."""

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split (transformers' `Qwen2Tokenizer`): words with their leading space,
digits one by one, punctuation runs, whitespace."""


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int) -> str:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `texts`, as `tokenizer.json`
    text: :data:`~nebula_rl.models.SPECIAL_TOKENS` first (the ids of the byte tokenizer), then
    the 256 byte symbols, then merges of pairs seen at least twice; Qwen2's pipeline (NFC, its
    word split, byte-level symbols and decoding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def gsm8k_texts(path: Path) -> list[str]:
    """Every question, then its answer, of a GSM8K JSON-lines file, in file order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [text for row in rows for text in (row["question"], row["answer"])]


def train_gsm8k_tokenizer(path: Path) -> str:
    """The GSM8K tokenizer (`tokenizer.json` text) trained on the GSM8K file at `path`."""
    return train_bpe_tokenizer(gsm8k_texts(path), vocab_size=GSM8K_VOCAB_SIZE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/gsm8k/train.jsonl"))
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the shipped file differs; write nothing"
    )
    args = parser.parse_args(argv)
    text = train_gsm8k_tokenizer(args.data)
    if args.check:
        same = GSM8K_TOKENIZER_FILE.read_text() == text
        print(f"{GSM8K_TOKENIZER_FILE}: {'up to date' if same else 'differs'}")
        return 0 if same else 1
    GSM8K_TOKENIZER_FILE.write_text(text)
    print(f"wrote {GSM8K_TOKENIZER_FILE} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
