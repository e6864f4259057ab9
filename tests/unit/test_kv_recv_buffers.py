"""A decode worker's receive buffers are reused up to a cap, never grown past it."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_transfer import KVLayout, ReceiveBuffers, TransferConfig, inprocess_pair

LAYOUT = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # one block of K and V over both layers, float32
CPU = torch.device("cpu")


def make_kv(seed: int, num_tokens: int) -> torch.Tensor:
    nb = math.ceil(num_tokens / LAYOUT.block_size)
    shape = (2, LAYOUT.num_layers, nb, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def transfer(buffers: ReceiveBuffers, peer: str, seed: int, num_tokens: int):
    """Send one payload over an in-process pair and receive it into `buffers`' tensor."""
    tx, rx = inprocess_pair(LAYOUT)
    kv = make_kv(seed, num_tokens)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(tx.send, f"req-{seed}", kv, num_tokens)
        header = rx.recv_header(5)
        out = buffers.view(peer, header, CPU)
        got = rx.recv_payload(header, out, 5)
        sent.result(5)
    assert torch.equal(got, kv)
    return got


def test_payloads_under_the_cap_reuse_one_buffer_per_channel():
    buffers = ReceiveBuffers(cap_bytes=4 * BLOCK_BYTES)
    first = transfer(buffers, "p0", 1, 16)  # 4 blocks: exactly the cap
    again = transfer(buffers, "p0", 2, 5)  # 2 blocks: the same storage
    assert again.data_ptr() == first.data_ptr()
    assert buffers.held_bytes == 4 * BLOCK_BYTES
    transfer(buffers, "p1", 3, 4)  # another channel has its own
    assert buffers.held_bytes == 5 * BLOCK_BYTES


def test_a_payload_over_the_cap_is_not_kept():
    buffers = ReceiveBuffers(cap_bytes=2 * BLOCK_BYTES)
    transfer(buffers, "p0", 1, 8)
    held = buffers.held_bytes
    big = transfer(buffers, "p0", 2, 40)  # 10 blocks: its own tensor, freed by the caller
    assert big.untyped_storage().nbytes() == 10 * BLOCK_BYTES
    assert buffers.held_bytes == held == 2 * BLOCK_BYTES
    buffers.drop("p0")
    assert buffers.held_bytes == 0


def test_the_cap_is_a_transfer_setting():
    assert TransferConfig().recv_buffer_mib == 256.0
    assert TransferConfig(recv_buffer_mib=0).recv_buffer_mib == 0
