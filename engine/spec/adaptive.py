"""How many tokens a request proposes this step (adaptive k).

Rule (docs/ARCHITECTURE.md, "Speculative decoding"): with per-token acceptance rate a, a step
proposing k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs 1 + c*k plain decode
steps, c = SpeculativeConfig.token_cost (drafting and verifying one more token). A request
proposes the k in [0, K] that maximises E(k) / (1 + c*k); k = 0 (plain decode) wins once a is
too low to pay. a is estimated per request from its own verifications (accepted / (accepted +
rejections), decayed, with a prior), so k shrinks and grows with what the request's text allows;
at k = 0 it probes with k = 1 every PROBE_EVERY steps so a recovering acceptance is noticed.
Whole steps skip speculation when the batch is compute-bound (SpeculativeConfig.max_batch).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig

PRIOR_ACCEPTED, PRIOR_TRIALS = 1.4, 2.0  # a starts at 0.7 for two tokens' worth of evidence
DECAY = 0.8  # weight of older evidence per verification
PROBE_EVERY = 8


@dataclass
class AcceptanceEstimate:
    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    idle_steps: int = 0  # steps at k = 0 since the last probe

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class AdaptiveK:
    def __init__(self, cfg: SpeculativeConfig):
        self.k_max, self.cost = cfg.k, cfg.token_cost
        self.estimates: dict[str, AcceptanceEstimate] = {}

    def k_for(self, request_id: str) -> int:
        est = self.estimates.setdefault(request_id, AcceptanceEstimate())
        k = best_k(est.rate, self.k_max, self.cost)
        if k == 0:
            est.idle_steps += 1
            if est.idle_steps >= PROBE_EVERY:
                est.idle_steps = 0
                return 1
        return k

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        est = self.estimates.setdefault(request_id, AcceptanceEstimate())
        # Tokens after the first rejection were never tested: one rejection, `accepted` successes.
        est.accepted = DECAY * est.accepted + accepted
        est.trials = DECAY * est.trials + accepted + (1 if accepted < proposed else 0)

    def forget(self, request_id: str) -> None:
        self.estimates.pop(request_id, None)


def best_k(rate: float, k_max: int, cost: float) -> int:
    """argmax over k in [0, k_max] of E(k) / (1 + cost*k); the smallest k on ties."""
    best, best_value = 0, 1.0
    emitted, power = 1.0, 1.0  # E(0) = 1
    for k in range(1, k_max + 1):
        power *= rate
        emitted += power  # E(k) = 1 + a + ... + a^k
        value = emitted / (1.0 + cost * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best
