"""LLMEngine: add_request / step / abort, plus generate() for offline use.

Roles (engine.config.Role): a mixed engine runs requests start to finish. A prefill
engine stops each request after its first token and holds its KV blocks until
export_kv()/release(). A decode engine takes requests with their KV via reserve() +
write_kv() + admit() (or import_kv() for all three) and continues them; with speculative.draft_kv
"ship" the draft's prompt KV goes along (export_kv; reserve_draft, write_draft_kv, admit).
"""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence as Seq

import torch

from engine.block_pool import BlockPool, NoFreeBlocks
from engine.cache_events import CacheEvent
from engine.config import EngineConfig, Role
from engine.engine_setup import EngineParts, build_parts
from engine.outputs import KVExport, RequestOutput, Usage
from engine.radix_cache import CacheStats
from engine.request_checks import check_fits, check_request, check_strings, check_text
from engine.sampler import sample_each_row, token_logprobs
from engine.sampling import InvalidRequest, SamplingParams, TokenLogprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceStatus
from engine.spec import build_draft_kv, build_speculator
from engine.step_log import StepLog
from engine.tokenizer import IncrementalDetokenizer, prompt_token_ids

Prompt = str | Seq[int]
log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        self.config = config
        p = parts or build_parts(config)
        self.model_id, self.model_config, self.tokenizer = p.model_id, p.model_config, p.tokenizer
        self.device, self.dtype, self.max_model_len = p.device, p.dtype, p.max_model_len
        self.runner, self.pool, self.cache, self.scheduler, self.sampler = (
            p.runner, p.pool, p.cache, p.scheduler, p.sampler)
        self.hicache = p.hicache  # host/disk tiers under the device pool, or None
        # Speculative decoding (engine.spec), or None when off.
        self.speculator = build_speculator(config, self.model_config, self.pool, self.sampler, self.max_model_len)
        self.draft_kv = build_draft_kv(  # the draft whose prompt KV travels with the target's, or None
            config, self.model_config, self.pool, self.sampler, self.speculator)
        self.block_size = config.cache.block_size
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.prefilled: dict[str, Sequence] = {}
        self.reservations: dict[str, list[int]] = {}
        self.draft_pending: dict[str, Sequence] = {}  # exported, their draft KV still to compute
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []  # finished outside step(), reported by the next step()
        self.step_log = StepLog()  # what the steps took, by kind and decode batch (stats()["step_times"])

    # -- requests ---------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field if the request can never run here."""
        check_request(token_ids, params, vocab_size=self.model_config.vocab_size,
                      max_model_len=self.max_model_len, block_size=self.block_size,
                      num_blocks=self.pool.num_blocks)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, *, checked: bool = False) -> None:
        """Queue a request; with `cache_salt` its prefix blocks are shared only with the same salt.

        `checked`: the request was checked against this model where it was built (a door's
        Backend.validate, before the GenerateRequest crossed to a worker), so only what needs
        this engine's own knowledge is checked here (its pool, its scheduler, its request ids),
        and the token range, which would otherwise fail the whole batch's forward pass.
        Unchecked (the engine used directly), the whole check runs here."""
        params = params or SamplingParams()
        if request_id in self.seqs or request_id in self.prefilled or request_id in self.reservations:
            raise InvalidRequest("request_id", f"request {request_id!r} is already in this engine")
        check_strings(prompt, params, cache_salt)  # checked or not: before the tokenizer sees them
        token_ids = self.tokenize(prompt)
        if checked:
            check_fits(token_ids, params, block_size=self.block_size, num_blocks=self.pool.num_blocks,
                       vocab_size=self.model_config.vocab_size)
        else:
            self.validate(token_ids, params)
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(token_ids) > sched.max_num_batched_tokens:
            # Unchunked, such a prompt would wait forever for a step big enough to hold it.
            raise InvalidRequest("prompt", f"prompt has {len(token_ids)} tokens; with chunked prefill off a "
                                           f"step computes at most {sched.max_num_batched_tokens}")
        seq = Sequence(request_id, token_ids, params, next(self._arrivals), cache_salt=cache_salt)
        if self.hicache is not None:
            try:
                self.hicache.prefetch(seq)  # disk reads start now, not when the request is scheduled
            except BaseException:
                self.hicache.forget(seq)  # refused to the caller: no read of it stays staged
                raise
        self._track(seq)
        self.scheduler.add(seq)

    def _track(self, seq: Sequence, emitted: list[int] | None = None) -> None:
        p = seq.params
        resumed = seq.prompt_token_ids[seq.num_prompt_tokens - p.resumed_tokens:]  # a continuation's output so far
        detok = IncrementalDetokenizer(self.tokenizer, resumed, p.resumed_chars)
        if emitted:  # the prefill side already streamed this text (less the same holdback)
            detok.update(emitted)
            detok.take(_holdback(seq.params))
        self.seqs[seq.request_id] = seq  # only once nothing above raised: a refusal leaves no trace
        self.detoks[seq.request_id] = detok

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def has_runnable(self) -> bool:
        """A step would do something: unlike has_unfinished, False when every request is held."""
        return self.scheduler.has_runnable() or bool(self._pending)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks. None if unknown or done."""
        if request_id in self.reservations:
            self.pool.release(self.reservations.pop(request_id))
        if self.draft_kv is not None:
            self.draft_kv.release(request_id)  # a draft reservation (a running request's mirror goes below too)
            self.draft_pending.pop(request_id, None)
        seq = self.prefilled.pop(request_id, None)
        if seq is not None:
            self.pool.release(seq.block_table)
            seq.block_table = []
        else:
            seq = self.seqs.get(request_id)
            if seq is None:
                return None
            self.scheduler.remove(seq)
            if self.hicache is not None:
                self.hicache.forget(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return self._finish_output(seq, [])

    def hold(self, request_id: str, held: bool) -> None:
        """Pause (True) or resume a request's decoding, keeping its KV: backpressure from a
        reader that fell behind. Unknown or finished requests are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.held = held

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns an output for every request that got a token, and for
        every request that failed in the step alone (finish_reason "error": an exception in its
        own scheduling, prefix matching, inputs, sampling, stop checks or detokenizing). Only a
        failure of the whole batch (the model's forward) raises."""
        outputs, self._pending = self._pending, []
        wall, cpu = time.perf_counter(), time.thread_time()  # the whole step, as sim calibrate times it
        batch = self.scheduler.schedule()
        outputs += self._scheduling_failures()
        if batch and self.speculator is not None:
            self.speculator.propose(batch)  # some decodes now verify 1 + k tokens
        batch = self._each_request(batch, self.runner.check_inputs, "input preparation", outputs)
        if not batch:
            return outputs
        decoding = sum(s.seq.num_computed >= s.seq.num_prompt_tokens for s in batch)
        sampled = [s for s in batch if s.samples]
        logits = self.runner.run(batch)
        results = self._sample_step(sampled, logits)
        self.scheduler.after_step(batch)
        if self.speculator is not None:
            self.speculator.rewind(sampled)
        if self.hicache is not None:
            self.hicache.after_step()
        self.step_log.record(decoding < len(batch), decoding, time.perf_counter() - wall, time.thread_time() - cpu)
        outputs += self._scheduling_failures()  # offering its blocks to the prefix cache
        for s, (tokens, lps) in zip(sampled, results):
            if s.seq.is_finished:  # failed above
                continue
            if isinstance(tokens, BaseException):
                outputs.append(self._fail(s.seq, tokens, "sampling"))
                continue
            try:
                outputs.append(self._append(s.seq, tokens, lps))
            except Exception as exc:  # stop checks, detokenizing: this request's own inputs
                outputs.append(self._fail(s.seq, exc, "stop checks or detokenizing"))
        return outputs

    def _each_request(self, batch: list[ScheduledSeq], work, stage: str,
                      outputs: list[RequestOutput]) -> list[ScheduledSeq]:
        """The hook for a per-request stage before the forward: `work` on each scheduled sequence;
        one that raises fails alone (its output into `outputs`) and leaves the batch."""
        kept = []
        for s in batch:
            try:
                work(s)
                kept.append(s)
            except Exception as exc:
                if s.num_draft:  # its proposals' tokens are not output
                    self.speculator.cancel(s)
                outputs.append(self._fail(s.seq, exc, stage))
        return kept

    def _scheduling_failures(self) -> list[RequestOutput]:
        """Fail the requests the scheduler took out of scheduling because their own work raised."""
        return [self._fail(f.seq, f.error, f.stage) for f in self.scheduler.take_failures()]

    def _sample_step(self, sampled: list[ScheduledSeq], logits: torch.Tensor) -> list[tuple]:
        """(tokens, logprobs) per sampling sequence: one sampled token per plain row, the verified
        run of a proposing sequence (engine.spec); an exception in place of tokens for a request
        whose row could not be sampled."""
        plain, plain_rows, spans, row = [], [], {}, 0
        for i, s in enumerate(sampled):
            if s.num_draft:
                spans[i] = row
            else:
                plain.append(i)
                plain_rows.append(row)
            row += 1 + s.num_draft
        results: list[tuple] = [((), ())] * len(sampled)
        if plain:
            seqs = [sampled[i].seq for i in plain]
            for i, token, lp in zip(plain, *self._sample(logits[plain_rows], seqs)):
                results[i] = (token, None) if isinstance(token, BaseException) else ([token], [lp])
        if spans:
            items = [(sampled[i], logits[start : start + 1 + sampled[i].num_draft]) for i, start in spans.items()]
            for i, (s, rows), tokens in zip(spans, items, self.speculator.verify(items)):
                if isinstance(tokens, Exception):
                    results[i] = (tokens, None)
                else:
                    lps = token_logprobs(rows[: len(tokens)], tokens, [s.seq.params.logprobs] * len(tokens))
                    results[i] = (tokens, lps)
        return results

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list, list]:
        """Tokens and logprobs per row of logits (N, V); a row that cannot be sampled gets its
        exception in place of a token, so only its own request fails."""
        positions = [q.num_tokens - q.num_prompt_tokens for q in seqs]
        return sample_each_row(self.sampler, logits, [q.params for q in seqs], positions)

    def _fail(self, seq: Sequence, exc: BaseException, stage: str) -> RequestOutput:
        """Finish one request that failed in a step, free its blocks, and log why under an id
        the client's answer carries (the client never sees the internal text)."""
        log_id = uuid.uuid4().hex[:12]
        log.error("request %s failed in %s (log id %s)", seq.request_id, stage, log_id, exc_info=exc)
        if self.prefilled.pop(seq.request_id, None) is not None:
            self.pool.release(seq.block_table)
            seq.block_table = []
        self.scheduler.remove(seq)
        if self.hicache is not None:
            self.hicache.forget(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            new_token_ids=[], text="", finished=True, finish_reason="error", usage=self._usage(seq),
            error=f"the request failed in the engine ({stage}); log id {log_id}")

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Append this step's tokens (one, or a verified speculative run) one at a time, checking
        stops after each: a stop inside the run drops the tokens after it."""
        detok = self.detoks[seq.request_id]
        new: list[int] = []
        reason = None
        for token, lp in zip(tokens, logprobs):
            seq.token_ids.append(token)
            new.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            detok.update(seq.output_token_ids)
            reason = self._stop_reason(seq, token, detok)
            if reason is not None:
                break
        if reason is not None:
            detok.finish()  # text == decode(output tokens), an unfinished last character included
        delta = detok.take(0 if reason else _holdback(seq.params))
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.scheduler.remove(seq)
            return self._finish_output(seq, new, delta)
        if self.config.role == Role.PREFILL:
            self.scheduler.remove(seq, release=False)
            seq.status = SequenceStatus.PREFILLED
            self.prefilled[seq.request_id] = self.seqs.pop(seq.request_id)
            self.detoks.pop(seq.request_id)
            return self._output(seq, new, delta, kv_ready=True)
        return self._output(seq, new, delta)

    def _stop_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and detok.text:
            window = max(map(len, p.stop)) + 16
            start = max(0, len(detok.text) - window)
            hits = [i for s in p.stop if (i := detok.text.find(s, start)) >= 0]
            if hits:
                detok.cut(min(hits))  # the stop string itself is not returned
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int], delta: str, kv_ready: bool = False) -> RequestOutput:
        text = self.detoks[seq.request_id].text if seq.request_id in self.detoks else delta
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            new_token_ids=new, text=text, new_text=delta, finished=seq.is_finished,
            finish_reason=seq.finish_reason, usage=self._usage(seq), logprobs=seq.logprobs, kv_ready=kv_ready,
        )

    def _finish_output(self, seq: Sequence, new: list[int], delta: str = "") -> RequestOutput:
        out = self._output(seq, new, delta)
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        return out

    def _usage(self, seq: Sequence) -> Usage:
        cached = seq.num_cached_tokens or 0
        by_tier = seq.cached_by_tier or ({"device": cached} if cached else {})
        return Usage(seq.num_prompt_tokens, len(seq.output_token_ids), cached, by_tier,
                     seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_spec_steps)

    # -- offline ----------------------------------------------------------------
    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run all prompts concurrently through the batcher; outputs in input order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        base = next(self._arrivals)
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if progress else None
        while len(done) < len(ids):
            for out in self.step():
                if out.finished or out.kv_ready:
                    done[out.request_id] = out
                    if bar:
                        bar[0].advance(bar[1])
        if bar:
            bar[0].stop()
        return [done[r] for r in ids]

    # -- disaggregation: prefill side --------------------------------------------
    def export_kv(self, request_id: str, release: bool = True, draft: bool = True) -> KVExport:
        """Copy a prefilled request's KV blocks out; by default free them here too. The draft's KV
        (when shipped) is computed now too, or with `draft` False later, by export_draft_kv."""
        seq = self.prefilled[request_id]
        blocks = seq.block_table[: -(-seq.num_computed // self.block_size)]
        kv = self.runner.read_blocks(blocks)  # (2, L, nb, bs, Hkv, hd), a copy
        draft_kv = self.draft_kv.export_prompt(seq, seq.num_computed) if self.draft_kv and draft else None
        if self.draft_kv is not None and not draft:
            self.draft_pending[request_id] = seq  # only its tokens are read, after its blocks went back
        out = KVExport(request_id, seq.prompt_token_ids, seq.token_ids[-1], seq.num_computed, kv, blocks,
                       seq.num_cached_tokens or 0, seq.logprobs[-1] if seq.logprobs else None, draft_kv)
        if release:
            self.release(request_id)
        return out

    def export_draft_kv(self, request_id: str) -> torch.Tensor | None:
        """The draft's KV of a request exported with draft=False (None: aborted since, or no room)."""
        seq = self.draft_pending.pop(request_id, None)
        return self.draft_kv.export_prompt(seq, seq.num_computed) if seq is not None else None

    def release(self, request_id: str) -> None:
        seq = self.prefilled.pop(request_id)
        self.pool.release(seq.block_table)
        seq.block_table = []

    # -- disaggregation: decode side ---------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks for an incoming request's KV before its payload arrives."""
        if request_id in self.reservations or request_id in self.seqs:
            raise InvalidRequest("request_id", f"request {request_id!r} is already in this engine")
        blocks = self.pool.allocate(-(-num_tokens // self.block_size))
        self.reservations[request_id] = blocks
        return blocks

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.runner.write_blocks(block_ids, kv)

    def reserve_draft(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Draft blocks for an incoming draft KV; None: none taken here (not "ship"), or no room."""
        return self.draft_kv.reserve(request_id, num_tokens) if self.draft_kv is not None else None

    def write_draft_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.draft_kv.write(block_ids, kv)

    def admit(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
              params: SamplingParams, cached_tokens: int = 0,
              first_logprobs: TokenLogprobs | None = None, cache_salt: str | None = None,
              draft_kv: bool = False) -> None:
        """Continue a prefilled request whose KV is already in its reserved blocks.

        `draft_kv`: its reserved draft blocks hold the draft's prompt KV too (else they are freed).
        A request the first token already finishes (EOS, max_tokens=1) is reported by the next
        step() and its blocks are freed; a refused one frees its reservation. The request was
        checked where it was built (a door, or import_kv): only whether its whole output fits
        this engine's pool is checked here.
        """
        try:
            check_fits(prompt_token_ids, params, block_size=self.block_size, num_blocks=self.pool.num_blocks,
                       vocab_size=self.model_config.vocab_size)
            if cache_salt is not None:
                check_text(cache_salt, "cache_salt")
        except InvalidRequest:
            self.pool.release(self.reservations.pop(request_id, []))
            if self.draft_kv is not None:
                self.draft_kv.release(request_id)
            raise
        seq = Sequence(request_id, list(prompt_token_ids), params, next(self._arrivals),
                       token_ids=list(prompt_token_ids) + [first_token_id],
                       num_computed=len(prompt_token_ids), block_table=self.reservations.pop(request_id),
                       num_cached_tokens=cached_tokens, status=SequenceStatus.WAITING, cache_salt=cache_salt)
        if first_logprobs is not None:
            seq.logprobs.append(first_logprobs)
        if self.draft_kv is not None and draft_kv:
            self.draft_kv.adopt(seq, len(prompt_token_ids))
        elif self.draft_kv is not None:
            self.draft_kv.release(request_id)
        self.scheduler.register_blocks(seq)
        self._track(seq, [first_token_id])
        reason = self._stop_reason(seq, first_token_id, self.detoks[request_id])
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.pool.release(seq.block_table)
            seq.block_table = []
            self._pending.append(self._finish_output(seq, []))
            return
        self.scheduler.add(seq)

    def import_kv(self, export: KVExport, params: SamplingParams) -> None:
        self.validate(export.prompt_token_ids, params)
        blocks = self.reserve(export.request_id, export.num_tokens)
        self.write_kv(blocks, export.kv)
        draft_blocks = self.reserve_draft(export.request_id, export.num_tokens) if export.draft_kv is not None else None
        if draft_blocks is not None:
            self.write_draft_kv(draft_blocks, export.draft_kv)
        self.admit(export.request_id, export.prompt_token_ids, export.first_token_id, params,
                   export.cached_tokens, export.first_logprobs, draft_kv=draft_blocks is not None)

    # -- introspection ----------------------------------------------------------
    def take_cache_events(self) -> list[CacheEvent]:
        """Cache events since the last call, oldest first (empty unless cache.record_events)."""
        return self.cache.events.take() if self.cache is not None else []  # an empty cache is falsy

    def stats(self) -> dict:
        cs = self.cache.stats if self.cache is not None else CacheStats()
        return {
            "num_blocks": self.pool.num_blocks, "free_blocks": self.pool.num_free,
            "referenced_blocks": self.pool.num_referenced, "cached_blocks": len(self.cache) if self.cache else 0,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "held": sum(seq.held for seq in self.scheduler.running),
            "prefilled": len(self.prefilled), "reserved": len(self.reservations),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_hit_rate": cs.hit_rate, "evicted_blocks": cs.evicted_blocks,
            "step_times": self.step_log.snapshot(),
            **({"hicache": self.hicache.snapshot()} if self.hicache is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.draft_kv.stats() if self.draft_kv is not None and self.speculator is None else {}),
        }

    def close(self) -> None:
        """Finish pending disk writes, stop the cache tiers' I/O threads, leave the rank group."""
        if self.hicache is not None:
            self.hicache.close()
        self.runner.close()


def _holdback(params: SamplingParams) -> int:
    """Characters of text kept back while a stop string could still be completing."""
    return max(map(len, params.stop)) - 1 if params.stop else 0


def _progress(total: int):
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)  # stdout carries the outputs
    bar.start()
    return bar, bar.add_task("generating", total=total)


__all__ = ["LLMEngine", "NoFreeBlocks", "BlockPool", "ScheduledSeq"]
