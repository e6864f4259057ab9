"""Payload checksums: fast, non-cryptographic, computed where the payload lives.

Two algorithms, one entry point (`payload_checksum`), chosen by the tensor's device:

- XXH3_64 (CPU): xxHash's xxh3_64 over the tensor's raw bytes, read in place through a
  numpy view (no copy); ~18 GB/s on this class of CPU.
- WSUM32 (CUDA, or anywhere on request): the bytes read as little-endian uint32 words u_i
  (a trailing partial word is zero padded) and reduced on the device as
      sum_i u_i * (2*i + 1)  +  nbytes * GOLDEN      (mod 2**64)
  in int64 arithmetic, in chunks to bound temporary memory. Only the final scalar reaches
  the host, so NCCL payloads never go through host memory. The weights are odd, so any
  change to a single word changes the sum; moving a word to another position changes it
  too. It is an integrity check against corruption, not a defence against an adversary.
"""
from __future__ import annotations

from enum import IntEnum

import torch
import xxhash

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # mixes the length in, so zero payloads of two sizes differ
_CHUNK_WORDS = 1 << 22  # 16 MiB of payload per reduction step; 3 int64 temporaries of 32 MiB


class ChecksumAlgo(IntEnum):
    """Wire ids of the checksum algorithms; never renumber one."""

    XXH3_64 = 1
    WSUM32 = 2


def payload_checksum(tensor: torch.Tensor,
                     algo: ChecksumAlgo | int | None = None) -> tuple[ChecksumAlgo, int]:
    """(algo, unsigned 64-bit checksum) of a contiguous tensor's bytes.

    algo None picks by device: XXH3_64 on CPU, WSUM32 elsewhere. XXH3_64 on a non-CPU tensor
    is refused rather than silently copied to the host. The tensor is only read.
    """
    if not tensor.is_contiguous():
        raise ValueError("payload_checksum needs a contiguous tensor (checksums cover raw bytes in place)")
    on_cpu = tensor.device.type == "cpu"
    if algo is None:
        algo = ChecksumAlgo.XXH3_64 if on_cpu else ChecksumAlgo.WSUM32
    algo = ChecksumAlgo(algo)
    raw = tensor.reshape(-1).view(torch.uint8)  # (nbytes,), same storage
    if algo is ChecksumAlgo.XXH3_64:
        if not on_cpu:
            raise ValueError(f"XXH3_64 runs on the host; the tensor is on {tensor.device}")
        return algo, xxhash.xxh3_64_intdigest(raw.numpy())
    return algo, _wsum32(raw)


def _wsum32(raw: torch.Tensor) -> int:
    """WSUM32 of a 1-D uint8 tensor, reduced on its own device."""
    nbytes = raw.numel()
    whole = nbytes - nbytes % 4
    acc = torch.zeros((), dtype=torch.int64, device=raw.device)
    if whole:
        words = raw[:whole].view(torch.int32)  # (n,), reinterpreted, little-endian
        for start in range(0, words.numel(), _CHUNK_WORDS):
            acc += _weighted_sum(words[start:start + _CHUNK_WORDS], start)
    if whole < nbytes:
        tail = torch.zeros(4, dtype=torch.uint8, device=raw.device)
        tail[: nbytes - whole] = raw[whole:]
        acc += _weighted_sum(tail.view(torch.int32), whole // 4)
    return (int(acc.item()) + nbytes * _GOLDEN) & _MASK64


def _weighted_sum(words: torch.Tensor, first_index: int) -> torch.Tensor:
    """sum u_i * (2i + 1) over one chunk, i counted from the payload's first word; int64
    overflow wraps, which is the intended mod 2**64."""
    u = words.to(torch.int64) & 0xFFFFFFFF  # (c,) the words as unsigned
    weights = torch.arange(first_index, first_index + words.numel(), dtype=torch.int64, device=words.device)
    return (u * (weights * 2 + 1)).sum()
