"""A CPU host's cores shared by processor sharing on the virtual clock: exact finishing
times as jobs come and go, background work that takes its share, no work lost or made up."""
from __future__ import annotations

import asyncio

import pytest

from sim.clock import run_virtual
from sim.cpu_host import CpuHost


def _ends(cores: float, jobs: list[tuple[float, float]], background: list[tuple[float, float]] = (),
          busy: float = 0.0, step: bool = False, oversubscribed: float = 1.0):
    """Each (start, cpu seconds) job's end, and the host (`busy`: its background cores), after
    running them all."""
    host = CpuHost(cores, background=busy, oversubscribed_slowdown=oversubscribed)

    async def job(start: float, cpu_s: float) -> float:
        await asyncio.sleep(start)
        await host.run(cpu_s, step=step)
        return asyncio.get_running_loop().time()

    async def spend(start: float, cpu_s: float) -> None:
        await asyncio.sleep(start)
        host.spend(cpu_s)

    async def main():
        for start, cpu_s in background:
            asyncio.get_running_loop().create_task(spend(start, cpu_s))
        return await asyncio.gather(*(job(s, c) for s, c in jobs))

    return run_virtual(main()), host


def test_no_more_jobs_than_cores_run_at_full_speed() -> None:
    ends, host = _ends(2, [(0.0, 1.0), (0.5, 1.0)])
    assert ends == pytest.approx([1.0, 1.5])
    assert host.cpu_s == pytest.approx(2.0)


def test_more_jobs_than_cores_share_them_fairly() -> None:
    # Three jobs on two cores: each at 2/3 speed until the first one ends.
    ends, host = _ends(2, [(0.0, 1.0), (0.0, 1.0), (0.0, 2.0)])
    assert ends[0] == pytest.approx(1.5) and ends[1] == pytest.approx(1.5)
    # The third did 1.0 of its 2.0 by then, and has a core to itself after.
    assert ends[2] == pytest.approx(2.5)
    assert host.cpu_s == pytest.approx(4.0)


def test_a_job_that_joins_slows_the_one_under_way() -> None:
    # One core: a alone for 0.5 s, then a and b at half speed each.
    ends, _ = _ends(1, [(0.0, 1.0), (0.5, 1.0)])
    assert ends[0] == pytest.approx(1.5)  # 0.5 done alone, the other 0.5 at half speed
    assert ends[1] == pytest.approx(2.0)  # 0.5 at half speed with a, then 0.5 alone


def test_background_work_takes_its_share_and_then_leaves_the_cores() -> None:
    # One core: 0.5 s of streaming work arrives with the job, two halves of the core until it is done.
    ends, host = _ends(1, [(0.0, 1.0)], background=[(0.0, 0.5)])
    assert ends == pytest.approx([1.5])
    assert host.cpu_s == pytest.approx(1.5) and host.running == 0
    # More background work added while some is left joins the same thread of it.
    ends, host = _ends(1, [(0.0, 1.0)], background=[(0.0, 0.25), (0.1, 0.25)])
    assert ends == pytest.approx([1.5]) and host.cpu_s == pytest.approx(1.5)


def test_a_cancelled_job_leaves_and_gives_its_share_back() -> None:
    host = CpuHost(1)

    async def main():
        loop = asyncio.get_running_loop()
        doomed = loop.create_task(host.run(10.0))
        loop.call_later(1.0, doomed.cancel)  # a worker killed mid-step
        await host.run(1.0)  # half speed for 1 s, then alone
        return loop.time()

    assert run_virtual(main()) == pytest.approx(1.5)
    assert host.running == 0


def test_a_host_needs_cores() -> None:
    with pytest.raises(ValueError, match="cores > 0"):
        CpuHost(0)
    with pytest.raises(ValueError, match="does not fit this host"):
        CpuHost(2, background=2.0)


def test_the_serves_idle_polling_slows_the_jobs_only_when_they_need_its_cores() -> None:
    """0.2 of 2 cores busy with no request in flight: one job still has a core; two share the 1.8
    left (0.9 each) until the first ends; three share it by thirds."""
    assert _ends(2, [(0.0, 1.0)], busy=0.2)[0] == pytest.approx([1.0])
    ends, host = _ends(2, [(0.0, 0.9), (0.0, 1.8)], busy=0.2)
    assert ends == pytest.approx([1.0, 1.9])  # 0.9 done in 1 s each, then the second alone at full speed
    assert host.cpu_s == pytest.approx(2.7)  # the jobs' work, not the background's
    assert _ends(2, [(0.0, 0.6)] * 3, busy=0.2)[0] == pytest.approx([1.0] * 3)


def test_steps_among_more_jobs_than_cores_do_their_work_slower() -> None:
    """Steps of 1 s on 2 cores with 0.2 busy, oversubscribed_slowdown 1.25: one step alone runs at
    full speed; two share 1.8 cores and each does its work 1.25x slower (0.72 a second) until the
    first ends; the serving path's jobs (not steps) only share."""
    assert _ends(2, [(0.0, 1.0)], busy=0.2, step=True, oversubscribed=1.25)[0] == pytest.approx([1.0])
    ends, _ = _ends(2, [(0.0, 0.72), (0.0, 1.0)], busy=0.2, step=True, oversubscribed=1.25)
    assert ends == pytest.approx([1.0, 1.28])  # then the second alone at full speed: 0.28 left
    assert _ends(2, [(0.0, 0.9)] * 2, busy=0.2, oversubscribed=1.25)[0] == pytest.approx([1.0] * 2)
    with pytest.raises(ValueError, match="oversubscribed_slowdown"):
        CpuHost(2, oversubscribed_slowdown=0.9)


async def _step_ends_at(host: CpuHost, cpu_s: float, prompt: bool, decode: bool) -> float:
    """A worker's step of `cpu_s` on `host`; the virtual time it ends."""
    await host.run(cpu_s, step=True, prompt=prompt, decode=decode)
    return asyncio.get_running_loop().time()


def test_corun_slowdown_slows_a_prompt_step_beside_a_step_that_decodes() -> None:
    host = CpuHost(2, corun_slowdown=2.0)

    def job(cpu_s: float, prompt: bool, decode: int = 0):
        return _step_ends_at(host, cpu_s, prompt, decode)

    async def main():
        alone = await job(1.0, True)  # no other step: full speed
        host.spend(0.5)  # streaming, but no other step
        beside_streaming = await job(1.0, True)
        # nor is a request's way in (work that is not a worker's step)
        beside_request, _ = await asyncio.gather(job(1.0, True), host.run(0.5))
        # nor another prompt step (cold prompts on two workers): a core each
        two_prompts = await asyncio.gather(job(1.0, True), job(1.0, True))
        # Beside a decoding step (a hit as another starts decoding): the prompt step gets 1/2 of
        # a core while the decode step runs (1 s), then the rest alone; the decode is not slowed.
        pair = await asyncio.gather(job(1.0, True), job(1.0, False, decode=1))
        # Beside one while tokens stream: 3 jobs, a fair share of 2/3 each, but the prompt step
        # gets 1/2 until the decode and the streaming end (1.5 s), then the rest alone.
        host.spend(1.0)
        streaming_pair = await asyncio.gather(job(1.0, True), job(1.0, False, decode=1))
        # On a full host (4 jobs, 2 cores) the fair share (0.5) is already at the ceiling
        # (1 / 2): the prompt step is not slowed twice, all four end together 2 s later.
        host.spend(1.0)
        full = await asyncio.gather(job(1.0, True), job(1.0, False, decode=1), host.run(1.0))
        # A colocated worker's mixed step (prompt tokens and answers of its own) beside another
        # worker's decoding step: no ceiling, a core each.
        mixed = await asyncio.gather(job(1.0, True, decode=2), job(1.0, False, decode=1))
        return alone, beside_streaming, beside_request, two_prompts, pair, streaming_pair, full[:2], mixed

    alone, beside_streaming, beside_request, two_prompts, pair, (prompt, decode), full, mixed = run_virtual(main())
    assert alone == pytest.approx(1.0)
    assert beside_streaming == pytest.approx(2.0)  # 1 s, no corun slowdown
    assert beside_request == pytest.approx(3.0)
    assert two_prompts == pytest.approx([4.0, 4.0])
    assert pair == pytest.approx([5.5, 5.0])
    assert decode == pytest.approx(7.0) and prompt == pytest.approx(7.25)
    assert full == pytest.approx([9.25, 9.25])
    assert mixed == pytest.approx([10.25, 10.25])
    with pytest.raises(ValueError, match="slowdown"):
        CpuHost(2, corun_slowdown=0.5)


def test_corun_span_ends_the_ceiling_that_long_after_the_prompt_step_starts() -> None:
    host = CpuHost(2, corun_slowdown=2.0, corun_span_s=0.5)

    def job(cpu_s: float, prompt: bool, decode: int = 0):
        return _step_ends_at(host, cpu_s, prompt, decode)

    async def main():
        loop = asyncio.get_running_loop()
        # 1 s of prompt beside a decoding step: half a core for 0.5 s (0.25 done), then a core.
        long, decode = await asyncio.gather(job(1.0, True), job(3.0, False, decode=1))
        # A step done within the span takes the whole ceiling: 0.2 s at half a core.
        started = loop.time()
        short, _ = await asyncio.gather(job(0.2, True), job(1.0, False, decode=1))
        short -= started
        # The span counts from the prompt step's start, not from the decoding's: alone 0.3 s
        # (0.3 done), capped 0.2 s (0.1), then a core for the 0.6 left.
        started = loop.time()
        prompt = loop.create_task(job(1.0, True))
        await asyncio.sleep(0.3)
        other = loop.create_task(job(3.0, False, decode=1))
        late = await prompt - started
        await other
        return long, decode, short, late

    long, decode, short, late = run_virtual(main())
    assert long == pytest.approx(1.25) and decode == pytest.approx(3.0)
    assert short == pytest.approx(0.4)
    assert late == pytest.approx(1.1)
    with pytest.raises(ValueError, match="span"):
        CpuHost(2, corun_span_s=0.0)


def test_corun_wait_delays_a_prompt_step_once_and_per_answer_beyond_the_first() -> None:
    host = CpuHost(2, corun_wait_s=0.25, corun_wait_per_answer_s=0.1)

    def job(cpu_s: float, prompt: bool, decode: int = 0):
        return _step_ends_at(host, cpu_s, prompt, decode)

    async def main():
        alone = await job(1.0, True)  # nothing beside it: no wait
        two_prompts = await asyncio.gather(job(1.0, True), job(1.0, True))  # nor beside a prompt step
        # Beside a decoding step: the prompt step waits 0.25 s off the cores, then runs 1 s;
        # the decode step is not delayed.
        loop = asyncio.get_running_loop()
        decode = loop.create_task(job(2.0, False, decode=1))
        await asyncio.sleep(0)  # the decode step is on the host first
        prompt = await job(1.0, True)
        decode = await decode
        # Beside steps decoding 3 answers in all (batches of 2 and 1): 0.25 s, and 0.1 s for
        # each of the 2 answers beyond the first.
        batches = [loop.create_task(job(2.0, False, decode=n)) for n in (2, 1)]
        await asyncio.sleep(0)
        started = loop.time()
        three = await job(1.0, True) - started
        await asyncio.gather(*batches)
        # A mixed step (answers of its own) does not wait beside them.
        other = loop.create_task(job(2.0, False, decode=3))
        await asyncio.sleep(0)
        started = loop.time()
        mixed = await job(1.0, True, decode=1) - started
        await other
        return alone, two_prompts, prompt, decode, three, mixed

    alone, two_prompts, prompt, decode, three, mixed = run_virtual(main())
    assert alone == pytest.approx(1.0)
    assert two_prompts == pytest.approx([2.0, 2.0])
    assert prompt == pytest.approx(3.25) and decode == pytest.approx(4.0)
    assert three == pytest.approx(0.45 + 1.5)  # then 3 jobs on 2 cores until the batches end
    assert mixed == pytest.approx(1.0)
    with pytest.raises(ValueError, match="wait"):
        CpuHost(2, corun_wait_s=-1.0)
    with pytest.raises(ValueError, match="wait"):
        CpuHost(2, corun_wait_per_answer_s=-1.0)


def test_a_wait_per_answer_alone_delays_a_prompt_step_beside_two_answers_not_one() -> None:
    host = CpuHost(2, corun_wait_per_answer_s=0.5)

    async def beside(answers: int) -> float:
        loop = asyncio.get_running_loop()
        decode = loop.create_task(_step_ends_at(host, 4.0, False, answers))
        await asyncio.sleep(0)
        started = loop.time()
        took = await _step_ends_at(host, 1.0, True, 0) - started
        await decode
        return took

    async def main():
        return await beside(1), await beside(2)

    one, two = run_virtual(main())
    assert one == pytest.approx(1.0) and two == pytest.approx(1.5)


def test_a_decode_workers_step_beside_another_workers_prompt_step_gets_at_most_its_ceiling() -> None:
    host = CpuHost(2, decode_corun_slowdown=2.0)

    async def decoding(cpu_s: float, decode: int = 1, receiving: bool = True) -> float:
        """A step of a disaggregated decode worker (`receiving`) or of a colocated one."""
        await host.run(cpu_s, step=True, decode=decode, receiving=receiving)
        return asyncio.get_running_loop().time()

    def prompt(cpu_s: float, decode: int = 0):
        return _step_ends_at(host, cpu_s, True, decode)

    async def main():
        alone = await decoding(1.0)
        two_decoding = await asyncio.gather(decoding(1.0), decoding(1.0, 2))  # no prompt: no ceiling
        # Beside a 1 s prompt step the decode step runs at half a core: 0.5 s of its work in the
        # first second, then the rest alone.
        beside = await asyncio.gather(decoding(1.0), prompt(1.0))
        # A mixed step (prompt tokens beside answers of its own) computes prompt tokens too.
        beside_mixed = await asyncio.gather(decoding(1.0), prompt(1.0, decode=1))
        # A colocated worker's decode step takes no requests in from others: a core of its own.
        colocated = await asyncio.gather(decoding(1.0, receiving=False), prompt(1.0))
        return alone, two_decoding, beside, beside_mixed, colocated

    alone, two_decoding, beside, beside_mixed, colocated = run_virtual(main())
    assert alone == pytest.approx(1.0)
    assert two_decoding == pytest.approx([2.0, 2.0])
    assert beside == pytest.approx([3.5, 3.0])
    assert beside_mixed == pytest.approx([5.0, 4.5])
    assert colocated == pytest.approx([6.0, 6.0])
    with pytest.raises(ValueError, match="decode_corun_slowdown"):
        CpuHost(2, decode_corun_slowdown=0.9)


def test_a_host_knows_how_long_its_cores_have_idled() -> None:
    host = CpuHost(2)

    async def main():
        loop = asyncio.get_running_loop()
        seen = [host.idle_s(loop.time())]  # nothing ever ran: idle for ever
        await asyncio.sleep(1.0)
        job = loop.create_task(host.run(0.5))
        await asyncio.sleep(0.2)
        seen.append(host.idle_s(loop.time()))  # busy
        await job
        host.spend(0.25)  # background work counts too
        await asyncio.sleep(1.0)
        seen.append(host.idle_s(loop.time()))
        return seen

    assert run_virtual(main()) == pytest.approx([float("inf"), 0.0, 0.75])
