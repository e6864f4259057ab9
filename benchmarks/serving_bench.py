"""Serving benchmark: a rate sweep of the shared-prefix workload (`brigade bench run`) against
`brigade serve` in disaggregated mode (P prefill + D decode workers) and in colocated mode
(P + D mixed workers: the same number of workers), one served fleet at a time on this machine.

Writes OUT/disaggregated/{result.json,report.html,*.png}, OUT/colocated/..., OUT/comparison.txt
(`brigade bench compare`, B = colocated over A = disaggregated), and benchmarks/results/
serving_bench.json (machine, ratios disaggregated / colocated at the highest offered rate with
targets, and every rate's headline figures: goodput at the SLO, p99 TTFT and ITL). --quick: a tiny
sweep (under a minute on an idle machine) writing serving_bench.quick.json and
OUT=benchmarks/results/serving_bench.quick.d.

The model: SmolLM2-135M-Instruct (`smollm2-135m`, pulled and converted on first use) in both
runs; --model tiny|bench picks a random-weight preset, or any registry name or checkpoint dir.
The default SLO is for SmolLM2 in float32 on a 2-core CPU, whose decode step cannot beat ~84 ms
(it reads 546 MB of weights; engine_bench's floor); on a GPU pass e.g. --slo ttft=200ms,tpot=50ms.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args
from benchmarks.harness.served import RAY_ENV, ROOT, served_fleet

NAME = "serving_bench"
TARGETS = {"goodput_disagg_vs_colocated": ">= 1.0", "p99_itl_disagg_vs_colocated": "<= 1.0"}
HEADLINE = ("request_throughput", "request_goodput", "output_throughput", "p99_ttft_ms", "median_ttft_ms",
            "p99_itl_ms", "median_tpot_ms", "cache_hit_ratio", "error_rate")


@dataclass(frozen=True)
class Plan:
    rates: str = "0.5,1,2,4"
    slo: str = "ttft=4s,tpot=300ms"
    groups: int = 8
    prompts_per_group: int = 8
    system_len: int = 1024
    question_len: int = 64
    output_len: int = 64
    num_blocks: int = 2048


FULL = Plan()
QUICK = Plan(rates="8,inf", slo="ttft=5s,tpot=1s", groups=2, prompts_per_group=3, system_len=64, question_len=8,
             output_len=8, num_blocks=256)


def bench(url: str, plan: Plan, label: str, out: Path) -> None:
    """`brigade bench run` of the plan's sweep against url, into out/label/."""
    subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "run", "--url", url, "--label", label,
                    "--output-dir", str(out / label), "--no-progress", "--workload", "shared-prefix",
                    "--num-groups", str(plan.groups), "--prompts-per-group", str(plan.prompts_per_group),
                    "--system-prompt-len", str(plan.system_len), "--question-len", str(plan.question_len),
                    "--output-len", str(plan.output_len), "--request-rate", plan.rates, "--slo", plan.slo,
                    "--warmup", "2", "--ignore-eos", "--return-token-ids", "--vocab-size", "4096"],
                   cwd=ROOT, env={**os.environ, **RAY_ENV}, check=True)


def mode(label: str, workers: list[str], plan: Plan, args, out: Path) -> dict:
    """One served fleet of `workers`, swept; its result.json."""
    flags = ["--mode", label, *workers, "--model", args.model, "--device", args.device,
             "--num-blocks", str(plan.num_blocks), "--http-port", "0", "--grpc-port", "0"]
    print(f"== {label}: brigade serve {' '.join(flags)}, rates {plan.rates}", flush=True)
    with served_fleet(flags, out / f"{label}.serve.log", timeout_s=300) as served:
        bench(served.http_base, plan, label, out)
    return json.loads((out / label / "result.json").read_text())


def summary(modes: dict[str, dict]) -> tuple[dict, dict]:
    """Ratios disaggregated / colocated at the highest offered rate, and every rate's headline figures."""
    top = {m: max(doc["runs"], key=lambda run: run["request_rate"]) for m, doc in modes.items()}

    def ratio(key: str) -> float | None:
        a, b = top["disaggregated"].get(key), top["colocated"].get(key)
        return a / b if a is not None and b else None

    ratios = {"goodput_disagg_vs_colocated": ratio("request_goodput"),
              "p99_ttft_disagg_vs_colocated": ratio("p99_ttft_ms"),
              "p99_itl_disagg_vs_colocated": ratio("p99_itl_ms"),
              "throughput_disagg_vs_colocated": ratio("request_throughput")}
    rows = {m: [{"request_rate": str(run["request_rate"]), **{k: run[k] for k in HEADLINE}} for run in doc["runs"]]
            for m, doc in modes.items()}
    return ratios, rows


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "a tiny sweep (under a minute idle); writes serving_bench.quick.json",
                    model=C.REAL_MODEL)
    ap.add_argument("--rates", help=f"request rates, comma-separated (default {FULL.rates})")
    ap.add_argument("--slo", help=f"the SLO goodput counts (default {FULL.slo})")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers of the disaggregated fleet")
    ap.add_argument("--decode", type=int, default=1, help="decode workers of the disaggregated fleet")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    for flag in ("groups", "prompts-per-group", "system-len", "question-len", "output-len"):
        ap.add_argument(f"--{flag}", type=int, help=f"the shared-prefix workload's {flag.replace('-', ' ')}")
    args = ap.parse_args(argv)
    model_info = C.prepare_model(args.model)  # a registry model is pulled once here, not in each fleet's start
    run = BenchRun(NAME, TARGETS, args)
    plan = run.plan(FULL, QUICK, rates=args.rates, slo=args.slo, groups=args.groups,
                    prompts_per_group=args.prompts_per_group, system_len=args.system_len,
                    question_len=args.question_len, output_len=args.output_len)
    out = (args.out_dir or C.RESULTS_DIR) / (run.name + (".d" if run.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    modes = {"disaggregated": run.phase("disaggregated", mode, "disaggregated", ["--prefill", str(args.prefill),
                                                                                 "--decode", str(args.decode)],
                                        plan, args, out),
             "colocated": run.phase("colocated", mode, "colocated", ["--decode", str(args.prefill + args.decode)],
                                    plan, args, out)}
    compare = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "compare",
                              str(out / "disaggregated" / "result.json"), str(out / "colocated" / "result.json")],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (out / "comparison.txt").write_text(compare)
    print(compare)
    ratios, rows = summary(modes)
    for label, figures in rows.items():
        for row in figures:
            print(f"{label:>13} rate {row['request_rate']}: goodput {row['request_goodput']:.2f} req/s, "
                  f"p99 TTFT {row['p99_ttft_ms']:.0f} ms, p99 ITL {row['p99_itl_ms']:.1f} ms")
    return run.finish(ratios, model=args.model, model_info=model_info, out_dir=str(out),
                      slo=modes["disaggregated"]["runs"][0]["slo"], config=modes["disaggregated"]["config"], **rows)


if __name__ == "__main__":
    sys.exit(main())
