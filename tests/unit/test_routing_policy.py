"""The routing rules as pure functions: the KV-aware TTFT estimate, its guard, the baselines."""
import random
import time
from dataclasses import dataclass

from router.config import RouterConfig
from router.index.query import PrefixHit
from router.index.view import RecentRoutes
from router.policy import RoundRobin, cached_tokens, pick_kv_aware, pick_least_loaded, pick_random, ttft_cost

BS = 16
# The mechanics at weight 1 and a guard in tokens only; the defaults have their own tests below.
CFG = RouterConfig(balance_slack_tokens=1000, balance_slack_prompts=0, cache_weight=1, host_load_cost=0.1,
                   disk_load_cost=0.3)


@dataclass
class W:
    worker_id: str
    inflight: int = 0
    queued_tokens: int = 0
    routed: int = 0


def test_the_worker_holding_the_prefix_wins_when_loads_are_close():
    pool = [W("a", queued_tokens=100), W("b"), W("c")]
    hits = {"a": PrefixHit(20, 20, 0, 0), "b": PrefixHit(2, 2, 0, 0)}
    assert pick_kv_aware(pool, hits, 400, BS, CFG).worker_id == "a"  # 100 + 80 beats 0 + 368
    assert ttft_cost(pool[0], hits["a"], 400, BS, CFG) == 100 + 400 - 320


def test_the_guard_keeps_a_hot_worker_from_taking_everything():
    pool = [W("a", queued_tokens=1500), W("b")]
    hits = {"a": PrefixHit(120, 120, 0, 0)}
    # By the estimate `a` wins (1500 + 2000 - 1920 = 1580 < 2000), but it is queued more than
    # the slack (1000) over `b`: not a candidate.
    assert ttft_cost(pool[0], hits["a"], 2000, BS, CFG) < ttft_cost(pool[1], PrefixHit(), 2000, BS, CFG)
    assert pick_kv_aware(pool, hits, 2000, BS, CFG).worker_id == "b"
    pool[0].queued_tokens = 900  # within the slack: its cache wins (900 + 80 < 2000)
    assert pick_kv_aware(pool, hits, 2000, BS, CFG).worker_id == "a"


def test_slow_tiers_cost_their_load_and_the_last_token_is_never_cached():
    hit_dev, hit_host, hit_disk = PrefixHit(10, 10, 0, 0), PrefixHit(10, 0, 10, 0), PrefixHit(10, 0, 0, 10)
    w = W("x")
    assert ttft_cost(w, hit_dev, 161, BS, CFG) == 1
    assert ttft_cost(w, hit_host, 161, BS, CFG) == 1 + 0.1 * 160
    assert ttft_cost(w, hit_disk, 161, BS, CFG) == 1 + 0.3 * 160
    assert cached_tokens(PrefixHit(10, 10, 0, 0), 160, BS) == 144  # a 160-token prompt recomputes its last block
    pool = [W("dev"), W("host")]
    assert pick_kv_aware(pool, {"dev": PrefixHit(6, 6, 0, 0), "host": PrefixHit(10, 0, 10, 0)}, 161, BS,
                         CFG).worker_id == "host"  # 65 + 0 vs 1 + 16


def test_a_cached_token_outweighs_a_queued_one_by_cache_weight():
    pool = [W("holder", queued_tokens=2000), W("idle")]
    hits = {"holder": PrefixHit(25, 25, 0, 0)}  # 400 of 500 tokens cached
    heavy = CFG.model_copy(update={"cache_weight": 6, "balance_slack_tokens": 10**9})
    assert ttft_cost(pool[0], hits["holder"], 500, BS, heavy) == 2000 + 500 - 6 * 400
    assert pick_kv_aware(pool, hits, 500, BS, heavy).worker_id == "holder"  # 100 < 500
    assert pick_kv_aware(pool, hits, 500, BS, CFG.model_copy(update={"balance_slack_tokens": 10**9})
                         ).worker_id == "idle"  # weight 1: 2100 > 500, the cache is given up
    pool[0].queued_tokens = 2500  # the weight bounds how far behind a holder may fall: 600 > 500
    assert pick_kv_aware(pool, hits, 500, BS, heavy).worker_id == "idle"


def test_the_guard_scales_with_the_prompt_so_one_queued_long_prompt_does_not_bar_a_worker():
    by_prompts = CFG.model_copy(update={"balance_slack_prompts": 2, "cache_weight": 6})
    pool = [W("holder", queued_tokens=3000), W("idle")]
    hits = {"holder": PrefixHit(120, 120, 0, 0)}  # 1920 of 2000 tokens
    tokens_only = by_prompts.model_copy(update={"balance_slack_prompts": 0})
    assert pick_kv_aware(pool, hits, 2000, BS, tokens_only).worker_id == "idle"  # 3000 > 1000 tokens of slack
    assert pick_kv_aware(pool, hits, 2000, BS, by_prompts).worker_id == "holder"  # within 2 x 2000 tokens
    pool[0].queued_tokens = 4001
    assert pick_kv_aware(pool, hits, 2000, BS, by_prompts).worker_id == "idle"  # beyond 4000: barred


def test_the_defaults_weigh_the_cache_and_scale_the_guard():
    d = RouterConfig()
    assert d.cache_weight > 1 and d.balance_slack_prompts >= d.cache_weight  # the guard never undercuts the weight


def test_ties_go_to_fewer_inflight_then_the_id():
    pool = [W("b", inflight=1), W("c"), W("a", inflight=1)]
    assert pick_kv_aware(pool, {}, 50, BS, CFG).worker_id == "c"
    assert pick_least_loaded(pool).worker_id == "c"


def test_round_robin_and_random_cover_every_worker():
    pool = [W("b"), W("a"), W("c")]
    rr = RoundRobin()
    assert [rr.pick("prefill", pool).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    rng = random.Random(0)
    assert {pick_random(pool, rng).worker_id for _ in range(50)} == {"a", "b", "c"}


def test_recent_routes_count_until_they_expire():
    recent = RecentRoutes(ttl_s=0.2)
    hs = [bytes([i]) * 32 for i in range(5)]
    recent.note(hs[:3], "a")
    assert recent.leading(hs, "a") == 3 and recent.leading(hs, "b") == 0
    assert recent.leading([hs[4]] + hs[:3], "a") == 0  # leading blocks only
    time.sleep(0.25)
    assert recent.leading(hs, "a") == 0
    recent.note(hs[:1], "b")  # prunes the expired entries
    assert set(recent.holders) == {hs[0]}


def test_a_short_shared_prefix_does_not_pull_new_conversations_onto_one_worker():
    pool = [W("a", routed=3), W("b", routed=1), W("c", routed=2)]
    system_prompt_only = {"a": PrefixHit(1, 1, 0, 0)}  # 16 of 400 tokens: under min_hit_fraction
    assert pick_kv_aware(pool, system_prompt_only, 400, BS, CFG).worker_id == "b"  # the least routed idle worker
    follow_up = {"a": PrefixHit(10, 10, 0, 0)}  # 160 of 400: a real hit
    assert pick_kv_aware(pool, follow_up, 400, BS, CFG).worker_id == "a"


def test_prefill_without_a_live_decode_partner_is_not_picked_for_decoding_requests():
    import asyncio

    from worker_fakes import FakeWorker, router_over

    from engine.messages import GenerateRequest
    from engine.sampling import SamplingParams

    workers = [FakeWorker("prefill-0", "prefill"), FakeWorker("prefill-1", "prefill"),
               FakeWorker("decode-0", "decode"), FakeWorker("decode-1", "decode")]
    # prefill-0's only partner (decode-0) is dead
    peers = {"prefill-0": {"decode-0"}, "prefill-1": {"decode-1"}, "decode-1": {"prefill-1"}}
    router = router_over(RouterConfig(policy="least_loaded"), *workers, colocated=False, peers=peers)
    router.pool.workers["decode-0"].healthy = False
    router.pool.workers["prefill-1"].inflight = 5  # busier, yet the only one whose prefill can reach a decode worker

    def pick(max_tokens: int) -> str:
        req = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
        return asyncio.run(router.picker.prefill("prefill", req))[0].worker_id

    assert pick(16) == "prefill-1"
    assert pick(1) == "prefill-0"  # a one-token answer needs no decode worker: load alone decides
