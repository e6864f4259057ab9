"""The advisor sees queues: the same mean rate needs more workers when arrivals are bursty,
and the bursts show as queue time in TTFT."""
from __future__ import annotations

from cluster.sim_bridge import from_loadtest
from loadtest.workloads import RandomWorkload
from sim.fleet import FleetConfig
from sim.plan import PlanConfig, _burst, candidates, plan

BASE = FleetConfig(model="bench", device="cpu-2core", num_blocks=2048)
WORK = RandomWorkload(num_prompts=60, input_len="256", output_len="8", seed=3)
SEARCH = PlanConfig(base=BASE, slo={"ttft": 0.6}, max_gpus=6, tp_sizes=(1,), policies=("kv_aware",),
                    modes=("colocated",))


def test_bursty_arrivals_at_the_same_mean_rate_need_a_bigger_fleet() -> None:
    smooth = plan(SEARCH, from_loadtest(WORK, rate=4.0, arrival="fixed"))
    bursty = plan(SEARCH, from_loadtest(WORK, rate=4.0, arrival="poisson", burstiness=0.25))
    assert smooth["recommended"]["gpus"] == 1 and smooth["recommended"]["queue_share_of_ttft"] < 0.05
    tried = {t["gpus"]: t for t in bursty["tried"]}
    assert bursty["recommended"]["gpus"] == 3 and sorted(tried) == [1, 2, 3]
    assert not tried[1]["meets"] and not tried[2]["meets"]
    assert tried[1]["queue_share_of_ttft"] > tried[3]["queue_share_of_ttft"] > 0.05  # the bursts queue
    assert bursty["burst"]["peak_rate"] > bursty["burst"]["mean_rate"]


def test_an_unreachable_slo_names_the_closest_fleet() -> None:
    # 1 ms TTFT: no fleet meets it; the answer is the cheapest of those meeting it most often
    cfg = SEARCH.model_copy(update={"slo": {"ttft": 0.001, "tpot": 10.0}, "max_gpus": 2})
    result = plan(cfg, from_loadtest(WORK, rate=4.0, arrival="fixed"))
    assert result["recommended"] is None and not any(t["meets"] for t in result["tried"])
    near = result["closest"]
    assert near["slo_met"] == max(t["slo_met"] for t in result["tried"])
    assert near["gpus"] == min(t["gpus"] for t in result["tried"] if t["slo_met"] == near["slo_met"])
    met = plan(SEARCH, from_loadtest(WORK, rate=4.0, arrival="fixed"))
    assert met["recommended"] is not None and met["closest"] is None


def test_headroom_passes_over_a_fleet_that_a_slower_device_tips_over() -> None:
    """3 workers meet a 300 ms TTFT for every request at the profile's speed, but with every
    cost 1.2x only 83% of them do: with 1.2x headroom the answer is 4 workers; without it, 3.
    A headroom is the plain search on the slowed device."""
    cfg = SEARCH.model_copy(update={"slo": {"ttft": 0.3}})
    work = from_loadtest(WORK, rate=8.0, arrival="poisson", burstiness=0.5)
    plain, margin = plan(cfg, work), plan(cfg.model_copy(update={"headroom": 1.2}), work)
    assert plain["recommended"]["gpus"] == 3 and plain["recommended"]["headroom_met"] == plain["recommended"]["slo_met"]
    three = next(t for t in margin["tried"] if t["gpus"] == 3)
    assert three["slo_met"] == 1.0 and three["headroom_met"] < cfg.goodput and not three["meets"]
    assert margin["recommended"]["gpus"] == 4 and margin["headroom"] == 1.2
    slowed = plan(cfg.model_copy(update={"base": cfg.base.model_copy(update={"slowdown": 1.2})}), work)
    assert [t["slo_met"] for t in slowed["tried"]] == [t["headroom_met"] for t in margin["tried"]]


def test_candidates_come_cheapest_first_and_fit_the_device() -> None:
    cfg = PlanConfig(base=FleetConfig(model="Llama-3-70B", device="H100-SXM"), slo={"ttft": 1.0}, max_gpus=4,
                     tp_sizes=(1, 2, 4))
    found = list(candidates(cfg))
    gpus = [g for g, _ in found]
    assert gpus == sorted(gpus) and gpus[0] == 2  # 70B in bf16 does not fit one 80 GB card
    assert all(f["prefill_tp"] > 1 and f["decode_tp"] > 1 for _, f in found)
    assert (4, {"mode": "disaggregated", "prefill": 1, "decode": 1, "prefill_tp": 2, "decode_tp": 2}) in found


def test_burst_is_the_busiest_window() -> None:
    arrivals = [0.0, 1.0, 2.0, 3.0] + [20.0 + 0.1 * i for i in range(20)] + [40.0]
    b = _burst(arrivals)
    assert b["mean_rate"] == (len(arrivals) - 1) / 40.0 and b["peak_rate"] == 2.0  # 20 in one 10 s window
