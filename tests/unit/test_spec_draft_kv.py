"""Disaggregated speculation with the draft's KV shipped (speculative.draft_kv "ship"): the plain
prefill and decode workers over an in-process pair. Greedy tokens equal the plain colocated
engine's; the decode worker's draft proposes from its first step; a corrupted draft payload is
caught by its checksum and the request recomputes; both of the decode worker's pools (target and
draft) and the prefill worker's are whole after finish and abort."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_helpers import PARAMS, PROMPTS, disaggregate, pool_whole
from support import wait_for

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, LLMEngine, Role
from engine.messages import GenerateRequest
from kv_transfer import KVTransferError, Msg, RefuseReason, TransferConfig, encode_header, inprocess_pair
from kv_transfer.checksum import payload_checksum
from kv_transfer.layout import make_draft_section, make_header
from prefill_worker import PrefillWorker

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SPEC = {"method": "draft", "draft_model": "tiny-draft", "k": 3, "draft_kv": "ship"}
IDS = (0, 2, 3, 5, 7, 11)  # prompts of 1, 15, 41 (shared prefix), 31, 64 and 203 (shared) tokens


def config(**fields) -> EngineConfig:
    return EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=128), **fields)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """Each request's tokens from the plain colocated engine, no speculation."""
    outs = LLMEngine(config()).generate([PROMPTS[i] for i in IDS], [PARAMS[i] for i in IDS])
    return {i: o.token_ids for i, o in zip(IDS, outs)}


@pytest.fixture
def workers():
    """A prefill and a decode worker, both with the draft model, over an in-process pair."""
    cfg = config(speculative=SPEC)
    transfer = TransferConfig(backend="gloo")
    prefill = PrefillWorker("prefill-s", cfg, transfer)
    decode = DecodeWorker("decode-s", cfg.model_copy(update={"role": Role.DECODE}), transfer)
    pair(prefill, decode, inprocess_pair(prefill.layout, timeout_s=30.0))
    yield prefill, decode
    for w in (prefill, decode):
        w.close()


def pair(prefill: PrefillWorker, decode: DecodeWorker, channels) -> None:
    """Wire an in-process pair between the two, as connect() and accept() do over gloo."""
    tx, rx = channels
    tx.draft_layout = prefill.draft_layout
    tx.peer, rx.peer = decode.worker_id, prefill.worker_id
    prefill.kv.channels[decode.worker_id], prefill.kv.senders[decode.worker_id] = tx, ThreadPoolExecutor(1)
    decode.kv.attach(rx)


def draft_pool_whole(stats: dict) -> bool:
    return (stats["draft_free_blocks"] == stats["draft_num_blocks"] and stats["draft_referenced_blocks"] == 0
            and stats["draft_requests"] == 0)


def whole(prefill: PrefillWorker, decode: DecodeWorker) -> bool:
    """Every pool whole, and nothing held for a draft KV still to compute or send."""
    return (all(pool_whole(s) and draft_pool_whole(s) for s in (prefill.stats(), decode.stats()))
            and not prefill.kv.outgoing and not prefill.engine.draft_pending and not decode.kv.handoffs)


def test_shipped_draft_kv_gives_the_plain_engines_tokens(workers, reference):
    prefill, decode = workers
    target_block = decode.engine.runner.kv_cache[:, :, 0].numel() * 4
    draft_block = decode.engine.draft_kv.runner.kv_cache[:, :, 0].numel() * 4
    for i in IDS:
        tokens, timing = disaggregate(prefill, decode, f"ship-{i}", PROMPTS[i], PARAMS[i])
        assert tokens == reference[i], f"request {i}"
        assert not timing.recomputed
        assert timing.transfer_bytes == -(-len(PROMPTS[i]) // 16) * (target_block + draft_block)
    tx, rx = prefill.channels["decode-s"].stats, decode.channels["prefill-s"].stats
    assert tx.payloads == rx.payloads == 2 * len(IDS)  # every request's draft KV went along
    assert whole(prefill, decode)


def test_the_decode_draft_computes_no_prompt(workers, reference):
    """The 203-token prompt's draft KV is computed on the prefill side; the decode side's draft
    runs only proposals (at most (k + 1) tokens per output token)."""
    prefill, decode = workers
    i = 11
    tokens, _ = disaggregate(prefill, decode, "seen", PROMPTS[i], PARAMS[i])
    assert tokens == reference[i]
    assert prefill.stats()["draft_computed_tokens"] == len(PROMPTS[i])
    assert 0 < decode.stats()["draft_computed_tokens"] <= (SPEC["k"] + 1) * PARAMS[i].max_tokens < len(PROMPTS[i])
    assert whole(prefill, decode)


def test_a_corrupted_draft_payload_is_caught_and_the_request_recomputes(workers, reference):
    prefill, decode = workers
    prefill.corrupt_next_payload("decode-s", draft=True)
    tokens, timing = disaggregate(prefill, decode, "bad-draft", PROMPTS[7], PARAMS[7])
    assert timing.recomputed and tokens == reference[7]
    assert decode.channels["prefill-s"].stats.checksum_failures == 1
    tokens, timing = disaggregate(prefill, decode, "after", PROMPTS[5], PARAMS[5])  # the pair is still good
    assert not timing.recomputed and tokens == reference[5]
    assert whole(prefill, decode)


def test_an_aborted_request_frees_both_decode_pools(workers):
    prefill, decode = workers
    prompt, params = PROMPTS[9], PARAMS[9]
    req = GenerateRequest("gone", prompt, params)
    handle = decode.reserve("gone", len(prompt), "prefill-s")
    assert handle is not None and decode.stats()["draft_requests"] == 1
    prefill.prefill(req, handle).result(timeout=30)
    assert decode.kv.wait(handle, req).draft_written
    assert decode.abort("gone") is None  # received, never admitted
    handle = decode.reserve("never-pulled", len(prompt), "prefill-s")
    prefill.prefill(GenerateRequest("never-pulled", prompt, params), handle).result(timeout=30)
    prefill.abort("never-pulled")  # its draft KV may still be computing, its send still queued: dropped either way
    decode.abort("never-pulled")  # whether or not its KV arrived
    assert wait_for(lambda: whole(prefill, decode), 10, "both workers whole")


def test_recompute_mode_sends_only_the_target_kv(reference):
    cfg = config(speculative=SPEC | {"draft_kv": "recompute"})
    prefill = PrefillWorker("prefill-r", cfg, TransferConfig(backend="gloo"))
    decode = DecodeWorker("decode-r", cfg.model_copy(update={"role": Role.DECODE}), TransferConfig(backend="gloo"))
    try:
        assert prefill.draft_layout is None and decode.draft_layout is None
        tx, rx = inprocess_pair(prefill.layout, timeout_s=30.0)
        pair(prefill, decode, (tx, rx))
        tokens, timing = disaggregate(prefill, decode, "re", PROMPTS[3], PARAMS[3])
        assert tokens == reference[3] and not timing.recomputed and rx.stats.payloads == 1
        assert pool_whole(prefill.stats()) and pool_whole(decode.stats())
        assert draft_pool_whole(decode.stats())
    finally:
        prefill.close()
        decode.close()


def test_draft_counts_that_disagree_with_the_reservation_are_refused_unallocated(workers):
    """A header whose draft section covers other tokens than were reserved is refused (the whole
    transfer: the caller recomputes) before any receive buffer is sized for it."""
    prefill, decode = workers
    tx = prefill.channels["decode-s"]
    handle = decode.reserve("r", 20, "prefill-s")  # 2 blocks of 16, for the target and the draft
    assert handle is not None
    kv = torch.zeros(2, tx.layout.num_layers, 2, 16, tx.layout.num_kv_heads, tx.layout.head_dim)
    d = tx.draft_layout
    draft = make_draft_section(torch.zeros(2, d.num_layers, 1, 16, d.num_kv_heads, d.head_dim), 9, d, 0)
    header = make_header("r", kv, 20, tx.layout, tx.shard, payload_checksum(kv), draft)
    ack = torch.zeros(2, dtype=torch.int64)

    def send() -> None:
        tx.link.send(torch.frombuffer(bytearray(encode_header(header)), dtype=torch.uint8), Msg.HEADER)
        tx.link.recv(ack, Msg.ACK)
    threading.Thread(target=send, daemon=True).start()
    with pytest.raises(KVTransferError, match="draft KV of 'r' claims 9 tokens in 1 blocks; 20 in 2 were reserved"):
        decode.kv.wait(handle, GenerateRequest("r", [1] * 20))
    assert wait_for(lambda: ack[1].item() == RefuseReason.CALLER, 5, "the refusal")
    assert decode.kv.buffers.held_bytes == 0
    decode.abort("r")
    assert whole(prefill, decode)
