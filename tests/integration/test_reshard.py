"""KV transfer between different TP sizes (kv_transfer.reshard).

End to end over real processes, gloo groups and transfer pairs: prefill TP=1 -> decode TP=2
and prefill TP=2 -> decode TP=1 give the single-process engine's tokens. Then the plan
itself: each decode rank gets exactly its heads in the fewest messages, and the header check
refuses a piece that is not this rank's.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import make_engine, make_prompts
from parallel_group import ROOT, finish, rank_env

from engine import SamplingParams
from engine.parallel.sharding import kv_head_range
from kv_transfer import KVLayout, LayoutMismatch, RefuseReason, inprocess_pair
from kv_transfer.layout import HeadShard
from kv_transfer.reshard import cut, header_shard, pieces_to, place, plan, shard_of

PROMPTS = make_prompts([5, 13], seed=11)
MAX_TOKENS = 6


def run_transfer(model, tmp_path, src_tp: int, dst_tp: int) -> list[list[int]]:
    common = {"model": str(model), "prompts": PROMPTS, "addr_dir": str(tmp_path), "max_tokens": MAX_TOKENS,
              "first_out": str(tmp_path / "first.json"), "out": str(tmp_path / "out.json"),
              "src_tp": src_tp, "dst_tp": dst_tp}
    procs = []
    for role, tp in (("decode", dst_tp), ("prefill", src_tp)):
        for rank in range(tp):
            parallel = {"tp_size": tp, "rank": rank, "rendezvous": f"file://{tmp_path}/{role}-store",
                        "timeout_s": 60}
            args = json.dumps({**common, "role": role, "parallel": parallel})
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "reshard_rank.py"), args],
                                          env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    finish(procs)
    return json.loads((tmp_path / "out.json").read_text())


def reference(model) -> list[list[int]]:
    torch.set_num_threads(1)
    engine = make_engine(model, num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1)])
def test_prefill_and_decode_of_different_tp_give_the_engines_tokens(src_tp, dst_tp, hf_checkpoints, tmp_path):
    model = hf_checkpoints.get("qwen3")
    assert run_transfer(model, tmp_path, src_tp, dst_tp) == reference(model)


# -- the plan ----------------------------------------------------------------------------------
SIZES = [1, 2, 4]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_the_head_rule_is_the_engines(num_kv_heads):
    for tp in SIZES:
        for rank in range(tp):
            s = shard_of(num_kv_heads, tp, rank)
            assert (s.head_start, s.head_count) == kv_head_range(8, num_kv_heads, tp, rank)


@pytest.mark.parametrize("num_kv_heads", [2, 4, 8])
@pytest.mark.parametrize("src_tp", SIZES)
@pytest.mark.parametrize("dst_tp", SIZES)
def test_each_decode_rank_gets_exactly_its_heads_in_the_fewest_messages(num_kv_heads, src_tp, dst_tp):
    kv = torch.randn(2, 3, 2, 4, num_kv_heads, 5)  # (2, L, nb, bs, Hkv, hd): the unsharded truth
    for dst in range(dst_tp):
        want = shard_of(num_kv_heads, dst_tp, dst)
        got = torch.full((2, 3, 2, 4, want.head_count, 5), float("nan"))
        pieces = pieces_to(num_kv_heads, src_tp, dst_tp, dst)
        for p in pieces:
            held = shard_of(num_kv_heads, src_tp, p.src_rank)
            local = kv[..., held.head_start : held.head_start + held.head_count, :]  # what the sender holds
            place(got, want, p.sender_shard(src_tp), cut(local, held, p))
        assert torch.equal(got, kv[..., want.head_start : want.head_start + want.head_count, :])
        # Fewest: one message per source rank whose distinct heads this rank needs.
        sources = {shard_of(num_kv_heads, src_tp, r).head_start for r in range(src_tp)}
        needed = {h for h in sources if want.head_start <= h < want.head_start + want.head_count}
        assert len(pieces) == max(1, len(needed))
    assert len(plan(num_kv_heads, src_tp, dst_tp)) == sum(
        len(pieces_to(num_kv_heads, src_tp, dst_tp, d)) for d in range(dst_tp))


def test_same_tp_sends_rank_to_rank():
    assert [(p.src_rank, p.dst_rank) for p in plan(2, 4, 4)] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_the_header_check_refuses_a_piece_meant_for_another_rank():
    layout = KVLayout("m", 2, 4, 8, 4, torch.float32)
    receiver = shard_of(4, 2, 1)  # decode rank 1 of 2: heads [2, 4)
    kv = torch.randn(2, 2, 1, 4, 2, 8)
    good = HeadShard(1, 0, 2, 2)  # from TP=1 rank 0: heads [2, 4) is rank 1's piece
    bad = HeadShard(1, 0, 0, 2)  # heads [0, 2): rank 0's piece
    for sender, ok in ((good, True), (bad, False)):
        tx, rx = inprocess_pair(layout, sender)
        rx.shard = receiver
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(tx.send, "req", kv, 4)
            if ok:
                header, payload = rx.receive()
                assert header_shard(header) == good and torch.equal(payload, kv)
                sent.result(timeout=5)
            else:
                with pytest.raises(LayoutMismatch) as info:
                    rx.recv_header()
                assert info.value.reason == RefuseReason.HEAD_RANGE and "not a piece for rank 1" in str(info.value)
                with pytest.raises(Exception, match="HEAD_RANGE|refused"):
                    sent.result(timeout=5)
