"""Train the byte-level BPE tokenizers shipped with the built-in presets.

Run once by hand; its outputs (`tokenizers/<name>/tokenizer.json`) are committed, so no
machine ever needs to retrain them and every preset checkpoint stays byte-identical.
The corpus is the Python standard library (.py, .txt, .rst, site-packages excluded),
which is on every machine with Python and needs no download; the committed files were
made from CPython 3.11.7 with tokenizers 0.23.3.

    RAYON_NUM_THREADS=1 python engine/assets/make_tokenizers.py [STDLIB_DIR]
"""
from __future__ import annotations

import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Ids 0, 1, 2 in every shipped tokenizer (presets.py records them; tests check them).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# name -> vocabulary size (both multiples of 64, so vocab_size == len(tokenizer)).
SIZES = {"bpe-4k": 4096, "bpe-32k": 32000}
SUFFIXES = {".py", ".txt", ".rst"}


def corpus(root: Path) -> Iterator[str]:
    """Yield the text of each corpus file in sorted order, skipping non-UTF-8 files."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if path.suffix not in SUFFIXES or "site-packages" in rel or not path.is_file():
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train(root: Path, vocab_size: int) -> Tokenizer:
    """A GPT-2 style byte-level BPE: every byte is in the alphabet, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(root), trainer=trainer)
    return tok


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else sysconfig.get_paths()["stdlib"])
    out_root = Path(__file__).resolve().parent / "tokenizers"
    for name, size in SIZES.items():
        tok = train(root, size)
        assert tok.get_vocab_size() == size, (name, tok.get_vocab_size())
        out = out_root / name / "tokenizer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        # Compact JSON keeps the committed file small; the bytes are copied verbatim.
        tok.save(str(out), pretty=False)
        print(f"{out}: vocab {tok.get_vocab_size()}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
