"""Device and link profiles: the figures a roofline needs, from sim/data/devices.json (each
with its source there) or from a profile `brigade sim calibrate` fitted on one machine."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

DATA = Path(__file__).parent / "data"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LinkProfile(_Frozen):
    name: str
    bandwidth: float = Field(gt=0)  # bytes/s, one direction
    latency_s: float = Field(ge=0)  # per transfer

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


class DeviceProfile(_Frozen):
    """What one device is: its rates, the fractions of them an engine reaches, its per-step
    costs, its memory. Each worker has its devices to itself (sim/worker.py's host seam)."""

    name: str
    peak_flops: float = Field(gt=0)  # dense, at dtype_bytes precision
    mem_bw: float = Field(gt=0)  # bytes/s
    mem_bytes: float = Field(gt=0)  # device memory: weights + KV pool
    compute_eff: float = Field(1.0, gt=0, le=1)  # reachable fraction of peak_flops
    bw_eff: float = Field(1.0, gt=0, le=1)  # reachable fraction of mem_bw
    # Attention's query-key work over the cached context (a prefix hit's, a later chunk's)
    # reaches this fraction of the matmuls' rate: 1 for fused GPU kernels; a CPU engine's paged
    # attention runs well below its GEMMs (calibrate fits it from prefills over cached prefixes).
    attn_eff: float = Field(1.0, gt=0, le=1)
    # The same for a decode batch's attention over its contexts (None: attn_eff): a few query
    # rows per KV head over every sequence's blocks (calibrate fits it from decode batches at
    # two contexts).
    decode_attn_eff: float | None = Field(None, gt=0, le=1)
    # And a fresh prompt's attention among its own tokens, on the dense causal kernel (calibrate
    # fits it from fresh prompts of several lengths; 1 for the catalog's GPUs).
    prompt_attn_eff: float = Field(1.0, gt=0, le=1)
    step_overhead_s: float = Field(0.0, ge=0)  # per engine step: launches, scheduling
    # Per sampled sequence per step: sampling and the sequence's bookkeeping (calibrate fits
    # it; a GPU's batched sampler makes it negligible there).
    seq_overhead_s: float = Field(0.0, ge=0)
    dtype_bytes: int = Field(2, ge=1)  # weights and KV
    intra_link: str = "nvlink4"  # between the ranks of one TP group
    inter_link: str = "rdma-ndr400"  # between a prefill and a decode worker

    def slowed(self, factor: float) -> DeviceProfile:
        """This device with every cost `factor` times as large: its rates divided by it, its
        per-step and per-sequence times multiplied. Links keep their own figures."""
        if factor < 1:
            raise ValueError(f"a slowdown is >= 1, not {factor}")
        if factor == 1:
            return self
        return self.model_copy(update={"peak_flops": self.peak_flops / factor, "mem_bw": self.mem_bw / factor,
                                       "step_overhead_s": self.step_overhead_s * factor,
                                       "seq_overhead_s": self.seq_overhead_s * factor})


def _catalog() -> dict:
    return json.loads((DATA / "devices.json").read_text())


def device_names() -> list[str]:
    return sorted(_catalog()["devices"])


def load_device(name_or_path: str) -> DeviceProfile:
    """A profile by catalog name (H100-SXM, H200, H20, cpu-2core) or a JSON file (calibrate's output)."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        data = json.loads(path.read_text())
        unknown = sorted(set(data) - set(DeviceProfile.model_fields))
        if unknown:
            raise ValueError(f"{path}: not a device profile's fields: {', '.join(unknown)} (a profile from an older "
                             "`brigade sim calibrate`?); calibrate again or remove them")
        return DeviceProfile.model_validate(data)
    devices = _catalog()["devices"]
    if name_or_path not in devices:
        raise ValueError(f"unknown device {name_or_path!r}: use one of {', '.join(sorted(devices))} "
                         "or a profile JSON written by `brigade sim calibrate`")
    return DeviceProfile(name=name_or_path, **devices[name_or_path])


def load_link(name: str) -> LinkProfile:
    links = {k: v for k, v in _catalog()["links"].items() if not k.startswith("_")}
    if name not in links:
        raise ValueError(f"unknown link {name!r}: use one of {', '.join(sorted(links))}")
    return LinkProfile(name=name, **links[name])
