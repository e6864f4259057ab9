"""OutputStream turns engine outputs into Chunks when they are delivered, not when read."""
import asyncio

from decode_worker.streams import OutputStream
from engine.outputs import RequestOutput, Usage
from engine.sampling import TokenLogprobs


def test_a_chunk_keeps_its_own_logprobs_when_the_engine_runs_ahead():
    async def main():
        stream = OutputStream()
        logprobs = [TokenLogprobs(7, -0.1)]  # the live sequence's list, shared by every output
        out = RequestOutput("r", [1], [7], [7], "a", False, None, Usage(1, 1, 0), logprobs, "a")
        stream.sink(out)
        logprobs.append(TokenLogprobs(9, -0.2))  # the next step, before the consumer reads
        done = RequestOutput("r", [1], [7, 9], [9], "ab", True, "length", Usage(1, 2, 0), logprobs, "b")
        stream.sink(done)
        return [c async for c in stream.chunks()]

    first, last = asyncio.run(main())
    assert [p.token_id for p in first.logprobs] == [7] and first.token_ids == [7]
    assert [p.token_id for p in last.logprobs] == [9] and last.finished
