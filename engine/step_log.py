"""What a worker's engine steps took, by kind and decode batch: the served side of the
question "is this worker slow because its machine is, or because of what runs beside it?".

A step is a "prompt" step when any of its sequences computes prompt tokens (a chunk of a
fresh prompt, a prefix hit's new tokens) and a "decode" step when all of them only extend
their answers. For each (kind, decoding sequences in the step) the log keeps how many steps
ran, their wall seconds and the stepping thread's CPU seconds. With one torch thread (a CPU
worker's usual share) the CPU seconds are the step's own compute, so wall - CPU is the time
it waited for a core, and CPU above an engine measured alone is a core that ran slower (its
cache and memory shared with another worker's step). With more threads the other threads'
work is not in the CPU seconds: only the wall time compares then.

Batch sizes up to EXACT_BATCHES are kept one by one (a small CPU fleet's decode batches);
larger ones fall into power-of-two buckets named by their upper bound, so a scrape's series
stay few however large max_num_seqs is.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

EXACT_BATCHES = 16


def batch_label(decoding: int) -> str:
    """The label of a step with `decoding` decoding sequences: "0".."16", then "32", "64", ..."""
    if decoding <= EXACT_BATCHES:
        return str(decoding)
    bound = EXACT_BATCHES
    while bound < decoding:
        bound *= 2
    return str(bound)


@dataclass
class StepTally:
    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def add(self, steps: int, wall_s: float, cpu_s: float) -> None:
        self.steps += steps
        self.wall_s += wall_s
        self.cpu_s += cpu_s


class StepLog:
    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str], StepTally] = {}

    def record(self, prompt: bool, decoding: int, wall_s: float, cpu_s: float, steps: int = 1) -> None:
        """`steps` steps of that kind and batch that took `wall_s` and `cpu_s` together."""
        key = ("prompt" if prompt else "decode", batch_label(decoding))
        self._tallies.setdefault(key, StepTally()).add(steps, wall_s, cpu_s)

    def snapshot(self) -> dict[str, dict[str, dict]]:
        """{kind: {batch label: {"steps", "wall_s", "cpu_s"}}}, totals since the engine started."""
        out: dict[str, dict[str, dict]] = {}
        for (kind, batch), tally in sorted(self._tallies.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            out.setdefault(kind, {})[batch] = asdict(tally)
        return out

