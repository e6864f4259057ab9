"""An external fuzzer at the HTTP door: schemathesis reads the door's own
GET /openapi.json from a real `brigade serve` (tiny preset, 1 prefill + 1 decode, a short
context so valid requests stay short) and sends what it generates from it, valid bodies
(positive) and bodies that break the schema (negative), to every operation. Every answer must
be below 500 and one the document lists, none may hang (a 60 s timeout), and afterwards the
same worker processes are alive, the door still serves, and the serve log records no engine
or internal failure. CI sends a few hundred cases; BRIGADE_CHAOS_FULL=1 ten times as many and
records the figure."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import requests
from serve_process import Served, brigade_serve, find_process
from support import FULL

SCALE = 10 if FULL else 1
# Per operation and generation mode; the generation routes carry the body schemas worth fuzzing.
EXAMPLES = {"POST /v1/completions": 60, "POST /v1/chat/completions": 40}
OTHER_EXAMPLES = 8
CONTEXT = 128
CALL_TIMEOUT_S = 60.0
FAILURE_MARKS = ("Traceback", "engine failed", "internal error", "EngineDied", "failed in")
WORKERS = ("ray::PrefillActor", "ray::DecodeActor")

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600 * SCALE)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("openapi_fuzz")
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "64", "--max-model-len", str(CONTEXT)]
    with brigade_serve(flags, tmp / "serve.log") as s:
        yield s


def worker_pids(served: Served) -> dict[str, int]:
    return {name: find_process(served, name).pid for name in WORKERS}


def fuzz(op, mode, base: str, session: requests.Session, statuses: Counter, failures: list[str]) -> None:
    """Send `op`'s generated cases of `mode`; count each answer's status (0: it hung), and
    collect, rather than raise, the bad ones (no shrinking: every case counts once)."""
    from hypothesis import HealthCheck, Phase, given, settings

    documented = {int(code) for code in op.definition.raw["responses"]}

    @settings(max_examples=EXAMPLES.get(op.label, OTHER_EXAMPLES) * SCALE, deadline=None, database=None,
              derandomize=True, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def send(case) -> None:
        try:
            resp = case.call(base_url=base, session=session, timeout=CALL_TIMEOUT_S)
        except requests.Timeout:
            statuses[0] += 1
            failures.append(f"{op.label} hung ({mode.value}): {case.body!r:.300}")
            return
        statuses[resp.status_code] += 1
        if resp.status_code >= 500 or resp.status_code not in documented:
            failures.append(f"{op.label} -> {resp.status_code} ({mode.value}): {case.body!r:.300} {resp.text[:300]}")

    send()


def test_schemathesis_finds_no_5xx_no_hang_and_kills_no_worker(served: Served, chaos_figure) -> None:
    import schemathesis
    from hypothesis.errors import Unsatisfiable

    base = served.http_base
    document = httpx.get(f"{base}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    before = worker_pids(served)
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    session = requests.Session()

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in schemathesis.GenerationMode:
            try:
                fuzz(op, mode, base, session, statuses, failures)
            except Unsatisfiable:  # nothing to break in an operation without inputs (GET /health)
                assert mode is schemathesis.GenerationMode.NEGATIVE, op.label

    after = worker_pids(served)
    alive = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=120)
    log = served.log.read_text()
    marks = [m for m in FAILURE_MARKS if m in log]
    cases = sum(statuses.values())
    server_errors = sum(n for code, n in statuses.items() if code >= 500)
    chaos_figure("openapi_fuzz", ratios={"server_errors": server_errors, "hangs": statuses[0],
                                         "worker_deaths": sum(before[w] != after[w] for w in WORKERS)},
                 targets={"server_errors": "== 0", "hangs": "== 0", "worker_deaths": "== 0"},
                 cases=cases, statuses={str(k): v for k, v in sorted(statuses.items())}, failures=failures[:20])
    print(f"\nschemathesis: {cases} cases, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:10])
    assert cases >= (150 if not FULL else 1500) and statuses[200] > 20 and statuses[400] > 20
    assert after == before, "a worker process was replaced"
    assert alive.status_code == 200
    assert not marks, f"the serve log records {marks}:\n{log[-3000:]}"
