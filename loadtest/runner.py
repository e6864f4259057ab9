"""Drives a target with a workload: sessions start at their arrival offsets, each turn waits for
the previous answer (and the think time), a semaphore caps requests in flight, and every
request becomes a RequestRecord. A rate sweep is one run per rate. Where the server counts its
engine steps (Brigade's /metrics), a run also records what they took meanwhile ("server_steps").

Each run of a sweep draws its prompts with seed + run index, so a later rate does not find the
earlier runs' prefixes already cached; warm-up requests use yet another seed for the same reason.
"""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from loadtest import server_steps
from loadtest.arrivals import arrival_offsets
from loadtest.config import BenchConfig
from loadtest.live import LiveProgress
from loadtest.metrics import parse_slo, summarize
from loadtest.targets import Target, make_target
from loadtest.types import Content, Message, Prompt, RequestRecord, Session, TargetError
from loadtest.workloads import build_sessions
from loadtest.workloads.tokens import random_ids, rng_for

WARMUP_SEED_OFFSET = 1_000_003


class Run:
    """One run: its sessions against one target, at given offsets, under one concurrency cap."""

    def __init__(self, target: Target, cfg: BenchConfig, seed: int, progress: LiveProgress | None = None):
        self.target, self.cfg, self.seed, self.progress = target, cfg, seed, progress
        cap = cfg.load.max_concurrency
        self.slots = asyncio.Semaphore(cap) if cap else None
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.duration_s = float("inf")

    async def execute(self, sessions: list[Session], offsets: list[float],
                      duration_s: float | None = None) -> tuple[list[RequestRecord], float]:
        """Every session to its end (or to `duration_s`); the records and the run's wall time."""
        self.t0 = time.perf_counter()
        self.duration_s = duration_s or float("inf")
        await asyncio.gather(*(self._session(i, s, off) for i, (s, off) in enumerate(zip(sessions, offsets))))
        return self.records, time.perf_counter() - self.t0

    async def _session(self, index: int, session: Session, offset: float) -> None:
        if offset >= self.duration_s:
            return  # decided by the schedule, not by how late this task woke
        await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
        history = [Message("system", session.system)] if session.system is not None else []
        for k, turn in enumerate(session.turns):
            if k and session.think_time_s:
                await asyncio.sleep(session.think_time_s)
            if k and time.perf_counter() - self.t0 >= self.duration_s:
                return
            history.append(Message("user", turn.content))
            prompt = Prompt(f"{session.id}-t{k}-s{self.seed}", session.id, tuple(history), turn.output_len)
            record, answer = await self._request(prompt, k)
            self.records.append(record)
            if self.progress:
                self.progress.add(record)
            if not record.ok:
                return  # the next turn would need this answer
            history.append(Message("assistant", self._answer_content(answer, record, turn.content, index, k)))

    async def _request(self, prompt: Prompt, turn: int) -> tuple[RequestRecord, tuple[str, list[int] | None]]:
        if self.slots:
            await self.slots.acquire()
        try:
            return await self._measure(prompt, turn)
        finally:
            if self.slots:
                self.slots.release()

    async def _measure(self, prompt: Prompt, turn: int) -> tuple[RequestRecord, tuple[str, list[int] | None]]:
        sent = time.perf_counter()
        rec = RequestRecord(prompt.request_id, prompt.session_id, turn, start_s=sent - self.t0,
                            prompt_tokens=prompt.expected_input_len)
        text: list[str] = []
        ids: list[int] = []
        ids_complete = True  # every token-carrying chunk came with its ids
        first_chunk_s: float | None = None

        async def consume() -> None:
            nonlocal ids_complete, first_chunk_s
            async for chunk in self.target.stream(prompt):
                if first_chunk_s is None:
                    first_chunk_s = chunk.time - sent
                if chunk.num_tokens:
                    rec.chunk_times_s.append(chunk.time - sent)
                    rec.chunk_tokens.append(chunk.num_tokens)
                    ids_complete &= chunk.token_ids is not None
                    ids.extend(chunk.token_ids or ())
                text.append(chunk.text)
                if chunk.usage:
                    rec.prompt_tokens = chunk.usage.prompt_tokens or rec.prompt_tokens
                    rec.output_tokens = chunk.usage.completion_tokens
                    rec.cached_tokens = chunk.usage.cached_tokens

        try:
            await asyncio.wait_for(consume(), self.cfg.target.timeout_s)
        except TargetError as exc:
            rec.error_kind, rec.error = exc.kind, str(exc)
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", f"no complete answer within {self.cfg.target.timeout_s} s"
        rec.e2e_s = time.perf_counter() - sent
        if rec.ok:
            # Usage (or token ids) count tokens; text cannot: a token ending inside a UTF-8
            # character streams no text. Such tokens arrived by the first chunk at the latest.
            rec.output_tokens = rec.output_tokens or sum(rec.chunk_tokens)  # no usage: count what came
            if not rec.chunk_times_s and rec.output_tokens and first_chunk_s is not None:
                rec.chunk_times_s, rec.chunk_tokens = [first_chunk_s], [rec.output_tokens]
            rec.ttft_s = rec.chunk_times_s[0] if rec.chunk_times_s else None
            if rec.ttft_s is None:
                rec.error_kind, rec.error = "no_tokens", "the answer carried no tokens"
        return rec, ("".join(text), ids if ids_complete and ids else None)

    def _answer_content(self, answer: tuple[str, list[int] | None], record: RequestRecord, asked: Content,
                        session: int, turn: int) -> Content:
        """The assistant message to resend next turn, in the prompt's own format. Token-id
        prompts need the answer's ids; when the server did not send them (no
        --return-token-ids), deterministic stand-in ids of the same length take their place
        (so the server's cached answer KV is not reused: ask for token ids to measure that)."""
        text, ids = answer
        if isinstance(asked, str):
            return text
        if ids:
            return ids
        n = max(1, record.output_tokens)
        return random_ids(rng_for(self.seed, 6, session, turn), n, self.cfg.workload.vocab_size)


def _sessions(cfg: BenchConfig, seed: int) -> list[Session]:
    return build_sessions(cfg.workload.model_copy(update={"seed": seed}))


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Every rate of the sweep in turn against one target; the result document (see report.py)."""
    slo = parse_slo(cfg.slo)
    target = make_target(cfg.target)
    runs = []
    try:
        for i, rate in enumerate(cfg.load.request_rates):
            seed = cfg.workload.seed + i
            if cfg.load.warmup:
                warm = _sessions(cfg, seed + WARMUP_SEED_OFFSET)[:cfg.load.warmup]
                warm = [Session(s.id + "-warmup", s.turns[:1], s.system) for s in warm]
                await Run(target, cfg, seed + WARMUP_SEED_OFFSET).execute(warm, [0.0] * len(warm))
            sessions = _sessions(cfg, seed)
            offsets = arrival_offsets(sessions, rate, cfg.load.arrival, cfg.load.burstiness, seed)
            total = sum(len(s.turns) for s in sessions)
            steps_before = await target.server_steps()
            with LiveProgress(f"rate {rate:g}/s", total, enabled=cfg.progress) as progress:
                records, duration = await Run(target, cfg, seed, progress).execute(sessions, offsets,
                                                                                   cfg.load.duration_s)
            steps_after = await target.server_steps() if steps_before is not None else None
            records.sort(key=lambda r: r.start_s)
            runs.append({"request_rate": rate, "burstiness": cfg.load.burstiness,
                         "max_concurrency": cfg.load.max_concurrency, "seed": seed,
                         **summarize(records, duration, slo), "records": records,
                         **({"server_steps": server_steps.between(steps_before, steps_after)}
                            if steps_after is not None else {})})
    finally:
        await target.aclose()
    return {"brigade_bench": 1, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "label": cfg.label, "backend": cfg.target.backend, "url": cfg.target.resolved_url,
            "endpoint": cfg.target.endpoint, "model_id": cfg.target.model, "workload": cfg.workload.kind,
            "config": cfg.model_dump(mode="json"), "runs": runs}
