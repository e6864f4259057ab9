"""Chaos: faults on the KV link itself — a TCP proxy between the two ends of a real gloo pair
(tests/kv_fault_proxy.py) delays, resets, truncates, stalls, duplicates and flips bytes.

The claim under test: every transfer ends with the exact KV, or with an error the decode
side turns into a recompute (the actor's path: decode_worker/actor.py) — never with
different KV that is silently used. Three levels:
- bytes: random single-byte flips in KV payloads (all caught by the checksum, the pair stays
  usable) and anywhere in a transfer's bytes (header, gloo framing: caught, refused, timed
  out, or harmless — and then the payload is bit-exact);
- tokens: real prefill and decode workers in this process, their pair through the proxy,
  each fault kind once: greedy tokens equal a single engine's;
- cluster: a real Ray cluster whose KV link's TCP connection is reset (`ss -K`): requests
  stay correct and the router rebuilds the pair.

CI runs reduced counts; BRIGADE_CHAOS_FULL=1 runs 1,000 flips of each kind.
"""
from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psutil
import pytest
import ray
import torch
import torch.distributed as dist
from cluster_helpers import disaggregate
from kv_fault_proxy import Fault, ProxiedStore, gloo_ports, proxied_pair
from ray_processes import actor_processes
from support import wait_for

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, LLMEngine, Role, SamplingParams
from engine.messages import GenerateRequest
from kv_transfer import (
    ChannelClosed,
    ChecksumMismatch,
    HeaderError,
    KVLayout,
    KVTransferError,
    ReceiverChannel,
    SenderChannel,
    TransferConfig,
    TransferRefused,
    new_ticket,
    rendezvous,
)
from prefill_worker import PrefillWorker

pytestmark = pytest.mark.usefixtures("torch_single_thread")

from support import FULL  # noqa: E402  (tests/ is on the path: tests/conftest.py)

FLIPS = 1000 if FULL else 60
LAYOUT = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
NUM_TOKENS = 64  # 4 blocks: a 16 KiB payload
TIMEOUT_S = 1.0  # per transfer step: a fault that stops the bytes costs this much


def make_kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    blocks = NUM_TOKENS // LAYOUT.block_size
    return torch.randn(2, LAYOUT.num_layers, blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                       generator=g)


class Pair:
    """A sender and a receiver channel over one proxied gloo pair, rebuilt after a failure."""

    def __init__(self):
        self.built = 0
        self.rebuild()

    def rebuild(self) -> None:
        self.built += 1
        tx, rx, self.proxy = proxied_pair(self.built, TIMEOUT_S)
        self.tx, self.rx = SenderChannel(tx, LAYOUT), ReceiverChannel(rx, LAYOUT)

    def transfer(self, rid: str, kv: torch.Tensor, fault: Fault | None = None) -> tuple[str, torch.Tensor | None]:
        """One request's header, ack and payload with `fault` armed on the sender's bytes.
        Returns (outcome, received payload or None); rebuilds the pair when the link failed."""
        def send() -> None:
            try:
                self.tx.send(rid, kv, NUM_TOKENS)
            except KVTransferError:
                pass  # the receiver's outcome says what happened

        self.proxy.arm(fault)
        sender = threading.Thread(target=send)
        sender.start()
        try:
            header = self.rx.recv_header()
            out = self.rx.recv_payload(header)
            outcome = "exact" if torch.equal(out, kv) else "SILENTLY DIFFERENT"
        except ChecksumMismatch:
            outcome, out = "checksum", None
        except (HeaderError, TransferRefused):
            outcome, out = "refused", None
        except ChannelClosed:
            outcome, out = "link_failed", None
        sender.join(timeout=3 * TIMEOUT_S + 5)
        assert not sender.is_alive(), "the sender hung"
        self.proxy.arm(None)
        if self.tx.broken or self.rx.broken:
            self.close()
            self.rebuild()
        return outcome, out

    def close(self) -> None:
        self.tx.close(), self.rx.close(), self.proxy.close()


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


def calibrate(pair: Pair) -> tuple[int, int]:
    """(bytes the sender puts on the wire per transfer, payload bytes): the payload's bytes are
    the last ones the sender writes for a request (gloo's framing precedes them)."""
    kv, before = make_kv(0), pair.proxy.sent_by(1)
    outcome, _ = pair.transfer("calibrate", kv)
    assert outcome == "exact"
    return pair.proxy.sent_by(1) - before, kv.numel() * kv.element_size()


@pytest.mark.timeout(600)
def test_every_single_byte_flip_in_a_kv_payload_is_caught(pair, chaos_figure):
    rng = random.Random(10)
    per_transfer, nbytes = calibrate(pair)
    outcomes: dict[str, int] = {}
    for i in range(FLIPS):
        kv = make_kv(i)
        offset = per_transfer - nbytes + rng.randrange(nbytes)
        outcome, _ = pair.transfer(f"flip-{i}", kv, Fault("flip", at=offset, mask=1 << rng.randrange(8)))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    outcome, got = pair.transfer("after", make_kv(-1))  # the pair is still usable
    print(f"\n{FLIPS} payload byte flips: {outcomes}; pairs built {pair.built}")
    chaos_figure("kv_payload_flips", {"caught_fraction": outcomes.get("checksum", 0) / FLIPS},
                 {"caught_fraction": "== 1.0"}, flips=FLIPS, outcomes=outcomes)
    assert outcomes == {"checksum": FLIPS}
    assert outcome == "exact" and torch.equal(got, make_kv(-1))


@pytest.mark.timeout(900)
def test_a_byte_flip_anywhere_in_a_transfer_is_caught_or_harmless(pair, chaos_figure):
    """Flips in the header (crc), the ack, gloo's framing, or the payload, in either direction."""
    rng = random.Random(11)
    per_transfer, _ = calibrate(pair)
    outcomes: dict[str, int] = {}
    for i in range(FLIPS):
        kv = make_kv(10_000 + i)
        from_rank = 1 if rng.random() < 0.9 else 0  # the receiver's bytes: ack and gloo notifications
        at = rng.randrange(per_transfer if from_rank == 1 else 64)
        outcome, got = pair.transfer(f"any-{i}", kv, Fault("flip", at=at, from_rank=from_rank,
                                                            mask=1 << rng.randrange(8)))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome == "exact":
            assert torch.equal(got, kv)
    print(f"\n{FLIPS} flips anywhere: {outcomes}; pairs built {pair.built}")
    chaos_figure("kv_stream_flips", {"silently_different": outcomes.get("SILENTLY DIFFERENT", 0)},
                 {"silently_different": "== 0"}, flips=FLIPS, outcomes=outcomes)
    assert "SILENTLY DIFFERENT" not in outcomes
    assert outcomes.get("checksum", 0) > 0  # most flips land in the payload


FAULTS = {  # name -> fault on the sender's bytes, `at` counted in payload bytes from its start
    "delay_within_timeout": Fault("delay", delay_s=0.3),
    "delay_past_timeout": Fault("delay", delay_s=TIMEOUT_S + 0.5),
    "reset": Fault("reset", at=4096),
    "truncate": Fault("truncate", at=4096),
    "stall": Fault("stall", at=4096),
    "duplicate": Fault("duplicate", at=4096, length=512),
    "flip": Fault("flip", at=4096),
    "ack_flip": Fault("flip", at=4, from_rank=0),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(FAULTS))
def test_each_link_fault_leaves_the_pair_correct_or_rebuilt(pair, name, chaos_figure):
    per_transfer, nbytes = calibrate(pair)
    fault = FAULTS[name]
    if fault.kind != "delay" and fault.from_rank == 1:
        fault = dataclasses.replace(fault, at=per_transfer - nbytes + fault.at)
    kv = make_kv(123)
    start = time.monotonic()
    outcome, got = pair.transfer(name, kv, fault)
    seconds = time.monotonic() - start
    after, got_after = pair.transfer(f"{name}-after", kv)
    print(f"\n{name}: {outcome} in {seconds:.2f} s; the next transfer: {after}")
    assert outcome != "SILENTLY DIFFERENT"
    assert outcome != "exact" or torch.equal(got, kv)
    assert seconds < 3 * TIMEOUT_S + 2, "a fault must end within the transfer's timeouts"
    if name == "delay_within_timeout":
        assert outcome == "exact"
    elif name == "duplicate":
        # The stream lost step: the payload is caught, or the next message is; either way the
        # pair ends up rebuilt and then moves KV exactly.
        if after != "exact":
            after, got_after = pair.transfer(f"{name}-after-2", kv)
    assert after == "exact" and torch.equal(got_after, kv)


# --- tokens: real workers, their pair through the proxy -------------------------------------------

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def proxied_workers():
    """A prefill and a decode worker in this process whose pairs are built through proxies
    (each rank's rendezvous store wrapped as the fault proxy needs; everything else real)."""
    stores: list[ProxiedStore] = []
    original = rendezvous._pair_link

    def via_proxy(store, prefix, rank, backend, config):
        stores.append(ProxiedStore(store, rank, config.host))
        return original(stores[-1], prefix, rank, backend, config)

    rendezvous._pair_link = via_proxy
    transfer = TransferConfig(backend="gloo", timeout_s=TIMEOUT_S, connect_timeout_s=30.0)
    cfg = EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=128))
    prefill = PrefillWorker("prefill-x", cfg, transfer)
    decode = DecodeWorker("decode-x", cfg.model_copy(update={"role": Role.DECODE}), transfer)

    def pair_up():
        with ThreadPoolExecutor(1) as pool:
            ticket = new_ticket()  # what the router hands both sides
            accepted = pool.submit(decode.accept, ticket)
            prefill.connect(decode.worker_id, decode.address, ticket)
            assert accepted.result(timeout=30) == prefill.worker_id
        return next(p for st in stores[-2:] for p in st.proxies if p.connections)

    try:
        yield prefill, decode, pair_up
    finally:
        rendezvous._pair_link = original
        prefill.close(), decode.close()


def serve_one(prefill: PrefillWorker, decode: DecodeWorker, rid: str, prompt: list[int]) -> tuple[list[int], bool]:
    """One request as the router drives the plain workers (DecodeWorker.stream: a failed
    transfer frees the reservation and recomputes on the decode worker). Returns (tokens, recomputed)."""
    tokens, timing = disaggregate(prefill, decode, rid, prompt, PARAMS)
    return tokens, timing.recomputed


@pytest.mark.timeout(300)
def test_link_faults_under_real_workers_never_change_the_tokens(proxied_workers, chaos_figure):
    prefill, decode, pair_up = proxied_workers
    proxy = pair_up()
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(20, 60))] for _ in range(len(FAULTS) + 1)]
    reference = [o.token_ids for o in LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1)).generate(
        prompts, PARAMS)]
    results = {}
    for i, (name, fault) in enumerate([*FAULTS.items(), ("none", None)]):
        if fault is not None and fault.kind != "delay":
            fault = dataclasses.replace(fault, at=600 + fault.at // 8)  # past the header, into the payload
        proxy.arm(fault)
        tokens, recomputed = serve_one(prefill, decode, f"x-{i}", prompts[i])
        proxy.arm(None)
        broken = prefill.channels[decode.worker_id].broken or decode.channels[prefill.worker_id].broken
        results[name] = {"recomputed": recomputed, "pair_broken": broken, "identical": tokens == reference[i]}
        if broken:  # what the router does when the workers report it (tested on a cluster below)
            prefill.disconnect(decode.worker_id), decode.drop_channel(prefill.worker_id)
            proxy = pair_up()
    wrong = [name for name, r in results.items() if not r["identical"]]
    print(f"\nlink faults under real workers: {results}")
    chaos_figure("kv_link_faults_tokens", {"wrong_outputs": len(wrong)}, {"wrong_outputs": "== 0"}, faults=results)
    assert not wrong, f"tokens differ from a single engine's under: {wrong}"
    assert not results["none"]["recomputed"] and not results["delay_within_timeout"]["recomputed"]
    assert results["reset"]["recomputed"] and results["flip"]["recomputed"]
    assert decode.stats()["free_blocks"] == decode.stats()["num_blocks"]


# --- cluster: reset the real KV link between two Ray actors ---------------------------------------

def _kill_socket(conn) -> bool:
    """Close one TCP connection of another process, as a network fault would (ss -K: needs
    CAP_NET_ADMIN and a kernel with INET_DIAG_DESTROY)."""
    (lhost, lport), (rhost, rport) = conn.laddr, conn.raddr
    res = subprocess.run(["ss", "-K", "src", f"{lhost}", "sport", "=", f":{lport}",
                          "dst", f"{rhost}", "dport", "=", f":{rport}"], capture_output=True, text=True)
    return res.returncode == 0 and f":{lport}" in res.stdout



# --- cluster: reset the real KV link between two Ray actors ---------------------------------------

@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster(prefill=1, decode=1, engine={"cache": {"num_blocks": 256}}, transfer={"timeout_s": 5.0})


def decode_store(cluster) -> tuple[dist.TCPStore, str]:
    """A client of the decode worker's rendezvous store, and its host."""
    host, port = ray.get(cluster.workers["decode-0"].address.remote())
    return dist.TCPStore(host, port, None, False, timedelta(seconds=10)), host


def pairs_built(cluster) -> set[str]:
    """The key prefix of each pair built on the decode worker's rendezvous store so far (a
    pairing's keys live under a prefix named by a hash of its ticket: found by listing)."""
    store, _ = decode_store(cluster)
    return {k.removesuffix("gloo//0/0") for k in store.list_keys() if k.endswith("/gloo//0/0")}


def kv_link_connections(cluster, pair: str) -> list:
    """The TCP connection(s) of the decode actor that carry the gloo traffic of the pair built
    under `pair` (a prefix from pairs_built): found by the gloo listening ports both ranks
    published in the decode worker's rendezvous store."""
    store, host = decode_store(cluster)
    ports = {p for rank in (0, 1) for p in gloo_ports(store.get(f"{pair}gloo//0/{rank}"), host)}
    conns = psutil.Process(next(iter(actor_processes(("DecodeActor",))))).net_connections("tcp")
    return [c for c in conns if c.status == psutil.CONN_ESTABLISHED and c.raddr
            and (c.laddr.port in ports or c.raddr.port in ports)]


def reset(conn) -> None:
    """Abort one TCP connection of another process, as a network fault would: `ss -K` (needs
    CAP_NET_ADMIN and a kernel with INET_DIAG_DESTROY; the Makefile installs iproute2)."""
    (lhost, lport), (rhost, rport) = conn.laddr, conn.raddr
    res = subprocess.run(["ss", "-K", "src", lhost, "sport", "=", f":{lport}", "dst", rhost, "dport", "=", f":{rport}"],
                         capture_output=True, text=True, timeout=10)
    assert res.returncode == 0 and f":{lport}" in res.stdout, f"ss -K could not reset {conn}: {res.stderr}"


def generate(cluster, rid: str, prompt: list[int]):
    async def run():
        tokens, last = [], None
        async for ref in cluster.router.generate.remote(GenerateRequest(rid, prompt, PARAMS)):
            last = await ref
            tokens += last.token_ids
        return tokens, last
    import asyncio

    return asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.timeout(240)
def test_a_reset_kv_link_is_recomputed_around_and_the_pair_rebuilt(cluster, chaos_figure):
    assert shutil.which("ss"), "iproute2's ss is needed: `make system-deps` installs it"
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 4096) for _ in range(40)] for _ in range(3)]
    reference = [o.token_ids for o in LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1)).generate(
        prompts, PARAMS)]
    tokens, last = generate(cluster, "link-0", prompts[0])
    assert tokens == reference[0] and not last.timing.recomputed

    (first,) = pairs_built(cluster)
    conns = kv_link_connections(cluster, first)
    assert conns, "found no gloo connection of the pair"
    for c in conns:
        reset(c)
    tokens, last = generate(cluster, "link-1", prompts[1])  # its transfer meets the dead link
    failed_at = time.monotonic()
    assert tokens == reference[1] and last.timing.recomputed

    # The workers report the broken pair; the router closes both ends and pairs them again.
    wait_for(lambda: any(kv_link_connections_or_none(cluster, p) for p in pairs_built(cluster) - {first}), 30,
             "the pair rebuilt")
    rebuilt_s = time.monotonic() - failed_at
    tokens, last = generate(cluster, "link-2", prompts[2])
    assert tokens == reference[2] and not last.timing.recomputed
    print(f"\nKV link reset: {len(conns)} connection(s) reset; the next request recomputed, identical; "
          f"pair rebuilt {rebuilt_s:.2f} s later; the one after moved its KV over the new pair")
    chaos_figure("kv_link_reset", {"rebuild_s": rebuilt_s}, {"rebuild_s": "<= 5"},
                 connections_reset=len(conns))


def kv_link_connections_or_none(cluster, pair: str) -> list:
    try:
        return kv_link_connections(cluster, pair)
    except dist.DistStoreError:  # that pair has not been built (yet)
        return []
