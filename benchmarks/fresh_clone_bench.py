"""Fresh-clone test runs: does `.ci/run` pass, every time, on a clone of this checkout's HEAD?

A newcomer's first `make test` (and CI's) starts from a clean clone: no .venv, no build
outputs, Ray and redis-server started cold. This clones HEAD N times beside this checkout (where
../shared, the tests' shared data, is found), each clone's log beside it as fresh-clone-*.log,
runs `bash .ci/run` in each (it installs everything, then runs `make test` and the extended
tier, `make test-extended`) and reads pytest's summary lines. The figures merge into
benchmarks/results/chaos.json (key prefix fresh_clone.) next to the chaos suite's start-up loop:

  fresh_clone.failures       failed + errored tests over all runs (target <= 0)
  fresh_clone.green_fraction runs whose .ci/run exited 0 (target >= 1.0)

Both are over this invocation's runs; the runs of earlier invocations stay in raw (earlier).

  python benchmarks/fresh_clone_bench.py              # 3 runs (~25 minutes each on 2 cores)
  python benchmarks/fresh_clone_bench.py --runs 1 --keep

--logs LOG[@COMMIT] ... records runs made by hand the same way (`git clone . X && cd X && bash
.ci/run > LOG 2>&1; echo rc=$? >> LOG`) instead of running new ones. --quick runs one clone with the
unit tests only (`make test PYTEST_ARGS=tests/unit`), a check of the path in about 3 minutes.
Nothing else should run on the machine meanwhile: the suite's timings are the point too.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _common as C

NAME = "chaos"
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"fresh_clone.failures": "<= 0", "fresh_clone.green_fraction": ">= 1.0"}
SUMMARY = re.compile(r"^=+ (?P<body>.*\d+ (?:passed|failed|error).*) in (?P<secs>[\d.]+)s")


def parse_log(text: str) -> dict:
    """pytest's summary lines (`make test`'s, then the extended tier's), summed, and the exit
    status (`rc=N`, appended by the caller) of one run."""
    out: dict = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "test_s": None, "rc": None}
    for line in text.splitlines():
        m = SUMMARY.match(line.strip())
        if m:
            out["test_s"] = round((out["test_s"] or 0.0) + float(m["secs"]), 2)
            for count, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", m["body"]):
                out["errors" if kind.startswith("error") else kind] += int(count)
        elif line.startswith("rc="):
            out["rc"] = int(line[3:])
    return out


def one_run(commit: str, keep: bool, quick: bool) -> dict:
    # Beside this checkout, as a user's clone is beside ../shared (the tests' shared data), never
    # under /tmp: a longer path is part of what a newcomer's machine differs in, not the point.
    clone = Path(tempfile.mkdtemp(prefix="fresh-clone-", dir=ROOT.parent))  # git clones into it: empty
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
    log = clone.with_suffix(".log")
    cmd = ["bash", ".ci/run"] if not quick else ["make", "test", "PYTEST_ARGS=tests/unit"]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=clone, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    wall = time.perf_counter() - t0
    with log.open("a") as f:
        f.write(f"rc={rc}\n")
    run = parse_log(log.read_text()) | {"wall_s": round(wall, 1), "commit": commit, "log": str(log)}
    if not keep:
        subprocess.run(["rm", "-rf", str(clone)], check=False)  # the log stays
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="fresh clones to test (default 3)")
    ap.add_argument("--logs", nargs="+", metavar="LOG[@COMMIT]",
                    help="record these .ci/run logs instead of running; @COMMIT: what the run tested (default HEAD)")
    ap.add_argument("--keep", action="store_true", help="keep each clone (its .venv) for a look afterwards")
    ap.add_argument("--quick", action="store_true", help="one clone, unit tests only; writes nothing")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if args.logs:
        runs = []
        for item in args.logs:
            log, _, commit = item.partition("@")
            runs.append(parse_log(Path(log).read_text()) | {"commit": commit or head, "log": log})
    else:
        runs = []
        n = 1 if args.quick else args.runs
        with C.progress("fresh-clone .ci/run", n) as advance:
            for _ in range(n):
                runs.append(one_run(head, args.keep, args.quick))
                r = runs[-1]
                print(f"  rc {r['rc']}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, "
                      f"tests {r['test_s']} s, all {r['wall_s']} s ({r['log']})", flush=True)
                advance(1)
    missing = [r["log"] for r in runs if r["rc"] is None or r["test_s"] is None]
    if missing:
        print(f"no pytest summary or rc= line in {', '.join(missing)}: the run was cut off; not recorded")
        return 1
    ratios = {"fresh_clone.failures": sum(r["failed"] + r["errors"] for r in runs),
              "fresh_clone.green_fraction": sum(r["rc"] == 0 for r in runs) / len(runs)}
    C.print_ratios(ratios, TARGETS, title=f"fresh clones ({len(runs)} runs)")
    if args.quick:
        return 0
    path = C.result_path(NAME)
    old = json.loads(path.read_text()) if path.exists() else {"ratios": {}, "targets": {}, "raw": {}}
    before = old["raw"].get("fresh_clone", {})  # the ratios are these runs'; earlier ones stay on record
    earlier = before.get("earlier", []) + before.get("runs", [])
    C.write_result(NAME, old.get("machine") or C.machine_info(), old["ratios"] | ratios, old["targets"] | TARGETS,
                   old["raw"] | {"fresh_clone": {"runs": runs, "earlier": earlier, "machine": C.machine_info()}})
    print(f"fresh-clone figures merged into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
