"""Load an HF-format checkpoint directory (safetensors, single or sharded) into CausalLM."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models import CausalLM
from engine.models.layers import RotaryEmbedding

# HF tensor name -> (our parameter name, which slice of it). Slices index dim 0 of packed
# params; the int is the shard's position among its siblings.
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """The checkpoint's files are missing, incomplete, or do not match its config."""


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [_inside(path, n) for n in names]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: shard(s) listed in the index are missing: {missing}")
    return files


def _inside(path: Path, name: object) -> Path:
    """A shard named by the index, refused unless it is a plain file name in `path`: a hostile
    index could otherwise point the loader at any file (`..`, an absolute path). Symlinked
    shards stay allowed: the Hugging Face cache links every file to its blob store."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or Path(name).is_absolute()):
        raise CheckpointError(f"{path}: the index names the shard {name!r:.80}; only a file name in the "
                              "model directory is allowed")
    return path / name


def iter_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model straight on `device` in `dtype` and fill it from the checkpoint."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = materialise(model, dtype, device)
    # Tables are computed in float32 on the device (to_empty left them uninitialised).
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}
    for hf_name, tensor in iter_tensors(checkpoint_files(path), device):
        for name, fill in _targets(hf_name, cfg):
            dst = _destination(params, name)
            if dst is None:
                raise CheckpointError(f"unexpected tensor {hf_name!r} for a {cfg.architecture} model")
            fill(dst, tensor, hf_name)
            filled[name] = filled.get(name, 0) + 1
    if cfg.tie_word_embeddings:
        _destination(params, "lm_head.weight").copy_(model.embed_tokens.weight.data)
        filled["lm_head.weight"] = 1
    _check_complete(model, cfg, filled)
    return model.eval()


def materialise(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Allocate a meta-device model's weights once, already in `dtype`, on `device`.

    The cast happens on the meta device, where it costs nothing; casting after to_empty
    would first allocate every weight in float32 (an 8B bfloat16 model: ~32 GB, then
    ~16 GB more for the copy). Left uninitialised: the loader fills every weight."""
    return model.to(dtype).to_empty(device=device)


def _destination(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor | None:
    """The tensor to fill for an HF-named weight; our Linear stores weights transposed."""
    if name in params:
        return params[name].data
    if name.endswith(".weight") and (t := params.get(name[: -len("weight")] + "weight_t")) is not None:
        return t.data.t()  # (out, in) view of the (in, out) storage
    if name.endswith((".w13", ".w2")) and name in params:
        return params[name].data
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise CheckpointError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)


def _slice_fill(shard: int, sizes: list[int]):
    start = sum(sizes[:shard])

    def fill(dst, src, name):
        _copy(dst.narrow(0, start, sizes[shard]), src, name)

    return fill


def _expert_fill(expert: int, start: int, size: int):
    def fill(dst, src, name):  # dst: (E, in, out); src: (out, in)
        _copy(dst[expert].t().narrow(0, start, size), src, name)

    return fill


def _fused_expert_fill(dst, src, name):  # transformers 5 layout (E, out, in)
    _copy(dst, src.transpose(1, 2), name)


def _targets(hf: str, cfg: ModelConfig):
    """Yield (our parameter name, fill function) for one checkpoint tensor."""
    if _IGNORED.match(hf):
        return
    if hf == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # some tied checkpoints still carry a copy
    name = hf.removeprefix("model.")
    if m := _EXPERT.match(name):
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        inter = cfg.moe_intermediate_size
        if proj == "down_proj":
            yield f"{prefix}.w2", _expert_fill(expert, 0, cfg.hidden_size)
        else:
            yield f"{prefix}.w13", _expert_fill(expert, 0 if proj == "gate_proj" else inter, inter)
        return
    if m := _FUSED_EXPERT.match(name):  # transformers 5 in-memory layout
        yield f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", _fused_expert_fill
        return
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        packed, shard = _PACKED[parts[-2]]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        sizes = [q, kv, kv] if packed == "qkv_proj" else [inter, inter]
        yield ".".join(parts[:-2] + [packed, parts[-1]]), _slice_fill(shard, sizes)
        return
    yield name, _copy


def _check_complete(model: CausalLM, cfg: ModelConfig, filled: dict[str, int]) -> None:
    """Every parameter got all its shards (fused expert tensors fill all experts at once)."""
    shards = {"qkv_proj": 3, "gate_up_proj": 2, "w13": 2 * cfg.num_experts, "w2": cfg.num_experts}
    missing = []
    for name, _ in model.named_parameters():
        key = name.removesuffix("_t")  # filled is keyed by the HF-style ".weight" name
        parts = key.split(".")
        need = shards.get(parts[-2] if parts[-1] in ("weight", "bias") else parts[-1], 1)
        got = filled.get(key, 0)
        if got < need and not (parts[-1] in ("w13", "w2") and got == 1):
            missing.append(name)
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint is missing weights for: {missing[:8]}{more}")
