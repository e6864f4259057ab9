"""Launch a tensor/expert-parallel engine as one process per rank (tests/parallel_rank.py),
rendezvous over a FileStore, and collect rank 0's outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import wait_for

ROOT = Path(__file__).resolve().parents[1]


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_group(model: Path, tmp: Path, prompts: list[list[int]], *, tp: int = 1, ep: int = 1,
              max_tokens: int = 8, timeout_s: float = 240, device: str = "cpu", **extra) -> list[dict]:
    world = max(tp, ep)
    out = tmp / f"out-tp{tp}-ep{ep}.json"
    store = tmp / f"store-tp{tp}-ep{ep}"
    procs = []
    for rank in range(world):
        args = {**extra, "model": str(model), "device": device, "prompts": prompts, "max_tokens": max_tokens,
                "out": str(out),
                "parallel": {"tp_size": tp, "ep_size": ep, "rank": rank, "rendezvous": f"file://{store}",
                             "timeout_s": 60}}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "parallel_rank.py"), json.dumps(args)],
                                      env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    finish(procs, timeout_s)
    return json.loads(out.read_text())


def finish(procs: list[subprocess.Popen], timeout_s: float = 90) -> None:
    """Wait for every rank; on a failure or a hang kill the rest and fail with all their logs."""
    # every rank done, or one failed: the others would only wait out their timeouts
    wait_for(lambda: all(p.poll() is not None for p in procs) or any(p.returncode not in (None, 0) for p in procs),
             timeout_s, raise_on_timeout=False)
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"rank exit codes {codes}:\n" + "\n---\n".join(logs)
