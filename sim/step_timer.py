"""Times the real engine's steps on this machine, now: a fresh prompt, a prompt after a cached
prefix (a prefix hit's step), a decode batch. `brigade sim calibrate` fits its device profile
from these (sim/calibrate.py).
"""
from __future__ import annotations

import time
from itertools import count

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

# Greedy, as `brigade bench` asks by default: sampling at a temperature draws from the whole
# vocabulary for every sequence of every step (about a millisecond a sequence more on a 2-core
# CPU), and a fit on sampled steps would put that into every simulated greedy step.
TEMPERATURE = 0.0


def tokens(n: int, salt: int) -> list[int]:
    """n prompt ids; distinct salts (< 1000) share no block."""
    return [7 + (salt * 7919 + 13 * i) % 1000 for i in range(n)]


class StepTimer:
    """One engine for prompts (its prefix cache holds each context once) and one per decode batch
    and context (its sequences keep running, `context` tokens of prompt each unless a decode
    names another, for up to `decode_budget` steps)."""

    def __init__(self, preset: str = "bench", dtype: str = "auto", context: int = 256, decode_budget: int = 1000,
                 threads: int | None = None, temperature: float = TEMPERATURE):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()  # a step's: a served worker stepping as this one has as many
        self.preset, self.dtype, self.context, self.decode_budget = preset, dtype, context, decode_budget
        self.temperature = temperature
        self._ids = count()
        self._salts = count(1)
        self._prefiller = self._engine(prefix_cache=True)
        self._prefixes: dict[int, list[int]] = {}
        self._decoders: dict[tuple[int, int], LLMEngine] = {}

    @property
    def dtype_bytes(self) -> int:
        return self._prefiller.dtype.itemsize

    def _engine(self, prefix_cache: bool = False) -> LLMEngine:
        from engine.config import CacheConfig, EngineConfig

        return LLMEngine(EngineConfig(model=self.preset, device="cpu", dtype=self.dtype,
                                      cache=CacheConfig(num_blocks=4096, enable_prefix_cache=prefix_cache)))

    def _salt(self) -> int:
        salt = next(self._salts)
        if salt >= 1000:  # tokens() would repeat an earlier prompt, whose blocks are cached
            raise RuntimeError("a StepTimer times at most 999 prompts; make a new one")
        return salt

    @staticmethod
    def _timed(engine: LLMEngine) -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def prefill(self, new: int, cached: int = 0) -> float:
        """Seconds of one step computing `new` fresh tokens after `cached` tokens of a cached prefix."""
        prefix: list[int] = []
        if cached:
            if cached not in self._prefixes:  # cached once (its own step not timed), hit by every later call
                self._prefixes[cached] = tokens(cached, self._salt())
                self._prefiller.add_request(f"c{next(self._ids)}", self._prefixes[cached] + [1],
                                            SamplingParams(max_tokens=1, temperature=self.temperature))
                self._timed(self._prefiller)
            prefix = self._prefixes[cached]
        self._prefiller.add_request(f"p{next(self._ids)}", prefix + tokens(new, self._salt()),
                                    SamplingParams(max_tokens=1, temperature=self.temperature))
        return self._timed(self._prefiller)

    def decode(self, batch: int, steps: int, context: int | None = None) -> list[float]:
        """Seconds of each of `steps` decode steps of `batch` running sequences of `context`
        tokens of prompt (None: the timer's)."""
        context = context or self.context
        engine = self._decoders.get((batch, context))
        if engine is None:
            engine = self._decoders[(batch, context)] = self._engine()
            for i in range(batch):
                engine.add_request(f"d{next(self._ids)}", [11 + (i + j) % 1000 for j in range(context)],
                                   SamplingParams(max_tokens=self.decode_budget, ignore_eos=True,
                                                  temperature=self.temperature))
            while engine.scheduler.waiting or any(s.num_computed < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
                engine.step()  # the prompts
        times = []
        for _ in range(steps):
            if len(engine.scheduler.running) < batch:
                raise RuntimeError(f"the decode batch of {batch} ran out of its {self.decode_budget} steps")
            times.append(self._timed(engine))
        return times
