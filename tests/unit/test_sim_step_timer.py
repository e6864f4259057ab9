"""StepTimer: the real engine's steps timed on this machine (what calibrate fits)."""
from __future__ import annotations

import pytest

from sim.step_timer import StepTimer

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_it_times_fresh_prompts_and_decode_batches_of_the_real_engine() -> None:
    timer = StepTimer("tiny", "float32", context=16, decode_budget=6)
    assert timer.dtype_bytes == 4
    assert timer.prefill(64) > 0 and timer.prefill(64) > 0
    assert timer._prefiller.stats()["prefix_hit_rate"] == 0  # distinct prompts share no block
    times = timer.decode(3, 4)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert timer._decoders[(3, 16)].stats()["running"] == 3
    with pytest.raises(RuntimeError, match="ran out"):
        timer.decode(3, 3)  # the prompt's step's token + 4 + 3 > 6: its sequences finished
    assert len(timer.decode(3, 2, context=40)) == 2  # a batch at another context: an engine of its own
    running = timer._decoders[(3, 40)].scheduler.running
    assert len(running) == 3 and all(s.num_prompt_tokens == 40 for s in running)
    # greedy, as `brigade bench` asks by default: what the calibrated steps must cost
    assert all(s.params.greedy for s in running)
    sampled = StepTimer("tiny", "float32", context=16, temperature=0.8)
    sampled.decode(2, 1)
    assert all(s.params.temperature == 0.8 for s in sampled._decoders[(2, 16)].scheduler.running)


def test_a_hit_computes_only_its_new_tokens_after_the_cached_prefix() -> None:
    timer = StepTimer("tiny", "float32")
    assert timer.prefill(8, cached=128) > 0
    assert timer._prefiller.stats()["prefix_hit_rate"] > 0
    assert list(timer._prefixes) == [128]  # cached once, by an untimed step, for every later hit
    timer.prefill(8, cached=128)
    assert list(timer._prefixes) == [128]


def test_more_prompts_than_distinct_salts_are_refused() -> None:
    timer = StepTimer("tiny", "float32")
    timer._salts = iter([999, 1000])
    timer.prefill(4)
    with pytest.raises(RuntimeError, match="at most 999"):
        timer.prefill(4)
