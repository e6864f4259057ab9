"""Streamed text deltas add up to the final text, and never leak part of a stop string."""
from __future__ import annotations

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams


def _stream(engine: LLMEngine, prompt, params: SamplingParams) -> tuple[list[str], str, str | None]:
    engine.add_request("r", prompt, params)
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            if out.finished:
                final = out
    return deltas, final.text, final.finish_reason


def test_deltas_join_to_text_and_hold_back_stop_strings():
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", cache=CacheConfig(num_blocks=64)))
    prompt = "The quick brown fox"
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    deltas, full, _ = _stream(engine, prompt, greedy)
    assert "".join(deltas) == full and len(full) > 6

    # A stop string made of two characters that straddle a token boundary somewhere in the output.
    stop = full[4:7]
    deltas, text, reason = _stream(engine, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                   stop=[stop]))
    assert reason == "stop"
    assert text == full[: full.find(stop)]
    assert "".join(deltas) == text  # nothing of the stop string was streamed, then taken back
    assert engine.pool.num_free == engine.pool.num_blocks
