"""Convert a GGUF file into an HF-layout checkpoint directory (config.json, safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that Brigade, transformers
and vLLM all load like any other checkpoint."""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from engine.durable import publish
from engine.gguf.config import hf_config
from engine.gguf.header import check_header
from engine.gguf.vocab import build_tokenizer
from engine.gguf.weights import GGUFError, iter_weights

SHARD_BYTES = 2 << 30  # safetensors files are written whole from memory: bound each one
MARKER = ".complete"

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)


def write_checkpoint(gguf_path: Path, out: Path, dtype: torch.dtype = torch.float32,
                     progress: Progress | None = None) -> None:
    """Fill the (existing, empty) directory `out` from `gguf_path`, weights cast to `dtype`.
    The header is checked within bounds before GGUFReader parses it (engine/gguf/header.py)."""
    check_header(gguf_path)
    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError, KeyError) as exc:
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    cfg = hf_config(reader)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    tok_text, tok_cfg = build_tokenizer(reader)
    _dump(cfg, out / "config.json")
    _dump({k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}, out / "generation_config.json")
    (out / "tokenizer.json").write_text(tok_text, encoding="utf-8")
    _dump(tok_cfg, out / "tokenizer_config.json")
    _write_weights(iter_weights(reader, cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"]),
                   len(reader.tensors), out, dtype, progress)


def _write_weights(weights, total: int, out: Path, dtype: torch.dtype, progress: Progress | None) -> None:
    """One model.safetensors, or shards of at most SHARD_BYTES each (written as they fill, so
    memory holds one shard) with an index, as save_pretrained lays them out."""
    shard: dict[str, torch.Tensor] = {}
    written: list[tuple[Path, list[str]]] = []

    def flush() -> None:
        path = out / f".shard-{len(written) + 1}"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    size = 0
    for done, (name, array) in enumerate(weights, 1):
        t = torch.from_numpy(array).to(dtype)
        if shard and size + t.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = t
        size += t.nbytes
        if progress:
            progress(done, total)
    flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, (path, names) in enumerate(written, 1):
        fname = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    _dump({"metadata": {}, "weight_map": weight_map}, out / "model.safetensors.index.json")


def _dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_atomically(gguf_path: Path, final: Path, dtype: torch.dtype = torch.float32,
                       progress: Progress | None = None) -> Path:
    """Convert into a temp dir beside `final` and rename it into place: a reader (or a crash)
    never leaves a half-written checkpoint at `final`. The marker is written last and the whole
    directory fsynced before the rename (engine/durable.py), so after a power loss `final` with
    its marker holds whole files. Returns `final`."""
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_checkpoint(gguf_path, tmp, dtype, progress)
        (tmp / MARKER).write_text(str(gguf_path) + "\n")
        try:
            publish(tmp, final, replace=False)
        except OSError:
            if not (final / MARKER).is_file():  # unmarked debris at final: replace it
                shutil.rmtree(final, ignore_errors=True)
                publish(tmp, final, replace=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
