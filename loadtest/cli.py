"""`brigade bench`: the flags, the one flags -> BenchConfig mapping, and the three commands
(run, report, compare). cluster/cli.py only mounts add_parser(); errors leave as UsageError
(one line naming the flag, exit 2), as for every brigade command."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

BENCH_EPILOG = """\
examples:
  brigade bench run --url http://127.0.0.1:8000 --workload random --num-prompts 200 --request-rate 4
  brigade bench run --workload shared-prefix --num-groups 8 --prompts-per-group 16 \\
      --system-prompt-len 2048 --question-len 64 --output-len 128 --request-rate 1,2,4,8 \\
      --slo ttft=200ms,tpot=50ms --ignore-eos --output-dir results/shared
  brigade bench run --workload trace --trace-file mooncake_trace.jsonl --num-prompts 500 \\
      --trace-length-scale 0.0625 --trace-time-scale 0.5
  brigade bench run --workload multi-turn --num-sessions 16 --num-turns 5 --think-time 2 \\
      --endpoint chat --prompt-format text --model my-model --url http://vllm-host:8000
  brigade bench run --backend brigade-grpc --url 127.0.0.1:50051 --workload random --max-concurrency 32
  brigade bench compare results/disagg/result.json results/colocated/result.json
  brigade bench report results/shared/result.json     # re-render report.html and its plots

Run 'brigade bench run --help' for every flag.
"""
RUN_EPILOG = """\
What is measured (per request, from send): TTFT to the first token-carrying chunk; ITL between
consecutive chunks; TPOT = (E2E - TTFT) / (output tokens - 1), so the first token is excluded;
E2E to the end of the stream; cached prompt tokens from usage.prompt_tokens_details.cached_tokens
(Brigade reports them; other servers may). Goodput counts completed requests per second that
met every --slo. Summary keys follow `vllm bench serve` (request_throughput, p99_ttft_ms, ...).

Load: sessions arrive open-loop at --request-rate (Poisson; --burstiness < 1 burstier, > 1
smoother; --arrival fixed for even spacing; inf: all at once), capped at --max-concurrency
requests in flight (with rate inf: a closed loop). A comma list of rates runs a sweep, each
rate with prompts from seed + its index so no run finds another's prefixes cached.
--warmup N sends N extra requests first and leaves them out. The trace workload replays its own
timestamps (--arrival trace, its default).

Prompts are token ids by default (exact lengths; Brigade and vLLM accept a list of ints as
/v1/completions' prompt); --prompt-format text sends deterministic word text instead (needed
for --endpoint chat and for servers that take only text). The same --seed gives the same requests.

Writes OUTPUT_DIR/result.json (summary and every request) and OUTPUT_DIR/report.html with plots.

examples:
  brigade bench run --workload random --input-len 128:512 --output-len 64 --num-prompts 100 --request-rate 2,4
  brigade bench run --workload shared-prefix --num-groups 4 --prompts-per-group 8 --request-rate inf \\
      --max-concurrency 8 --warmup 4 --slo ttft=500ms,tpot=50ms
  brigade bench run --workload trace --trace-file my_trace.jsonl --trace-start 600 --trace-window 300 \\
      --trace-length-scale 0.125 --trace-time-scale 2
  OPENAI_API_KEY=sk-... brigade bench run --url https://api.example.com --endpoint chat --prompt-format text \\
      --model gpt-x --workload multi-turn --num-sessions 4
"""

TARGET_FLAGS = {"backend": "--backend", "url": "--url", "endpoint": "--endpoint", "model": "--model",
                "api_key_env": "--api-key-env", "timeout_s": "--timeout", "temperature": "--temperature",
                "ignore_eos": "--ignore-eos", "return_token_ids": "--return-token-ids", "extra_body": "--extra-body"}
WORKLOAD_FLAGS = {
    "seed": "--seed", "prompt_format": "--prompt-format", "vocab_size": "--vocab-size",
    "num_prompts": "--num-prompts", "input_len": "--input-len", "output_len": "--output-len",
    "num_groups": "--num-groups", "prompts_per_group": "--prompts-per-group",
    "system_prompt_len": "--system-prompt-len", "question_len": "--question-len", "num_turns": "--num-turns",
    "think_time_s": "--think-time", "num_sessions": "--num-sessions", "path": "--trace-file",
    "start_s": "--trace-start", "window_s": "--trace-window", "block_size": "--trace-block-size",
    "length_scale": "--trace-length-scale", "output_scale": "--trace-output-scale",
    "time_scale": "--trace-time-scale",
}
LOAD_FLAGS = {"request_rates": "--request-rate", "arrival": "--arrival", "burstiness": "--burstiness",
              "max_concurrency": "--max-concurrency", "warmup": "--warmup", "duration_s": "--duration"}
OTHER_FLAGS = {"slo": "--slo", "output_dir": "--output-dir", "label": "--label"}



class UsageError(ValueError):
    """A bad `bench` flag (a ValueError: `brigade` reports it as one line, exit code 2)."""


def _rates(value: str) -> list[float]:
    try:
        return [math.inf if v.strip() == "inf" else float(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 1,2,4 or inf, got {value!r}") from None


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object like '{\"top_p\": 0.9}'")
    return obj


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Mounts `bench` (run, report, compare) on the brigade command line."""
    fmt = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", formatter_class=fmt, epilog=BENCH_EPILOG,
                           help="load-test Brigade or any OpenAI-compatible server",
                           description="Load-test a server: workloads (random, shared-prefix, multi-turn, "
                                       "trace replay), open/closed-loop load, SLO goodput, reports with plots.")
    cmds = bench.add_subparsers(dest="bench_command", required=True, metavar="<run|report|compare>")
    bench.set_defaults(run="loadtest.cli", make_config=bench_config)

    run = cmds.add_parser("run", formatter_class=fmt, epilog=RUN_EPILOG, help="run a load test",
                          description="Send a workload to a server and write result.json and report.html.")
    t = run.add_argument_group("target")
    t.add_argument("--backend", choices=["openai-http", "brigade-grpc"], default="openai-http")
    t.add_argument("--url", help="http://HOST:PORT of an OpenAI-compatible server (default http://127.0.0.1:8000),"
                                 " or HOST:PORT for brigade-grpc (default 127.0.0.1:50051)")
    t.add_argument("--endpoint", choices=["completions", "chat"], help="default completions")
    t.add_argument("--model", help="model name sent with each request (default: none, the server's own)")
    t.add_argument("--api-key-env", metavar="VAR", help="env variable with a bearer token (default OPENAI_API_KEY)")
    t.add_argument("--timeout", type=float, metavar="S", help="per request (default 600)")
    t.add_argument("--temperature", type=float, metavar="T", help="default 0 (greedy)")
    t.add_argument("--ignore-eos", action="store_true", default=None,
                   help="generate exactly the output length (vLLM/Brigade extension)")
    t.add_argument("--return-token-ids", action="store_true", default=None,
                   help="ask for token ids per chunk (vLLM/Brigade extension): exact token counts, and "
                        "multi-turn token prompts resend the real answer")
    t.add_argument("--extra-body", type=_json_object, metavar="JSON", help="fields merged into every request body")

    w = run.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn", "trace"], default="random")
    w.add_argument("--seed", type=int, help="default 0: the same seed sends the same requests")
    w.add_argument("--prompt-format", choices=["ids", "text"], help="default ids (text with --endpoint chat)")
    w.add_argument("--vocab-size", type=int, metavar="V", help="token ids are drawn from [16, V) (default 4096)")
    w.add_argument("--num-prompts", type=int, metavar="N", help="random: requests (default 100); trace: the first N")
    w.add_argument("--input-len", metavar="SPEC", help="random, multi-turn: N | LO:HI | normal:MEAN,STD | A,B,C")
    w.add_argument("--output-len", metavar="SPEC", help="random, multi-turn: as --input-len; shared-prefix: N")
    w.add_argument("--num-groups", type=int, metavar="G", help="shared-prefix: system prompts (default 4)")
    w.add_argument("--prompts-per-group", type=int, metavar="Q", help="shared-prefix: questions each (default 8)")
    w.add_argument("--system-prompt-len", type=int, metavar="N", help="shared-prefix (1024), multi-turn (0)")
    w.add_argument("--question-len", type=int, metavar="N", help="shared-prefix: tokens per question (64)")
    w.add_argument("--num-turns", type=int, metavar="T", help="shared-prefix (1), multi-turn (4)")
    w.add_argument("--think-time", type=float, metavar="S", help="between an answer and the next turn")
    w.add_argument("--num-sessions", type=int, metavar="N", help="multi-turn: conversations (default 8)")
    w.add_argument("--trace-file", metavar="F.jsonl", help="trace: a Mooncake-format JSONL file (required)")
    w.add_argument("--trace-start", type=float, metavar="S", help="trace: skip requests before S seconds")
    w.add_argument("--trace-window", type=float, metavar="S", help="trace: only S seconds from --trace-start")
    w.add_argument("--trace-block-size", type=int, metavar="N", help="trace: tokens per hash id (512)")
    w.add_argument("--trace-length-scale", type=float, metavar="X", help="trace: scales blocks and input lengths")
    w.add_argument("--trace-output-scale", type=float, metavar="X", help="trace: scales output lengths")
    w.add_argument("--trace-time-scale", type=float, metavar="X", help="trace: scales timestamps (0.5: 2x faster)")

    ld = run.add_argument_group("load")
    ld.add_argument("--request-rate", type=_rates, metavar="R[,R...]", help="sessions/s; a list is a sweep "
                                                                           "(default inf)")
    ld.add_argument("--arrival", choices=["poisson", "fixed", "trace"],
                    help="default poisson (trace for --workload trace)")
    ld.add_argument("--burstiness", type=float, metavar="B", help="gamma shape of gaps (default 1: Poisson)")
    ld.add_argument("--max-concurrency", type=int, metavar="N", help="requests in flight at most")
    ld.add_argument("--warmup", type=int, metavar="N", help="requests sent first and left out (default 0)")
    ld.add_argument("--duration", type=float, metavar="S", help="stop starting sessions after S seconds")

    o = run.add_argument_group("output")
    o.add_argument("--slo", metavar="K=V,...", help="goodput SLOs: ttft, tpot, itl, e2el in ms or s, "
                                                   "e.g. ttft=200ms,tpot=50ms")
    o.add_argument("--output-dir", metavar="DIR", help="where result.json and report.html go (bench-results)")
    o.add_argument("--label", help="a name for this run in reports and comparisons")
    o.add_argument("--no-progress", action="store_true", help="no live progress display")

    rep = cmds.add_parser("report", formatter_class=fmt, help="re-render report.html from a result.json",
                          description="Re-render report.html and its plots from a result.json.")
    rep.add_argument("result", metavar="RESULT.json")
    rep.add_argument("--output-dir", metavar="DIR", help="default: the result's directory")

    cmp = cmds.add_parser("compare", formatter_class=fmt, help="two results side by side, with ratios",
                          description="Two results side by side, rate by rate, with B / A (green: B better).",
                          epilog="example:\n  brigade bench compare disagg/result.json colocated/result.json")
    cmp.add_argument("a", metavar="A.json")
    cmp.add_argument("b", metavar="B.json")


def bench_config(args: argparse.Namespace):
    """The one place `bench run` flags become a BenchConfig; problems are named by their flag."""
    if args.bench_command != "run":
        return None
    from pydantic import ValidationError

    from loadtest.config import BenchConfig
    from loadtest.workloads import CONFIGS

    def given(**values) -> dict:
        return {k: v for k, v in values.items() if v is not None}

    workload = given(**{field: getattr(args, flag[2:].replace("-", "_")) for field, flag in WORKLOAD_FLAGS.items()})
    for field in workload:
        if field not in CONFIGS[args.workload].model_fields:
            users = [kind for kind, model in CONFIGS.items() if field in model.model_fields]
            raise UsageError(f"{WORKLOAD_FLAGS[field]} applies to --workload {' or '.join(users)}, "
                             f"not {args.workload}")
    if args.endpoint == "chat" and args.prompt_format is None:
        workload["prompt_format"] = "text"
    target = given(backend=args.backend, url=args.url, endpoint=args.endpoint, model=args.model,
                   api_key_env=args.api_key_env, timeout_s=args.timeout, temperature=args.temperature,
                   ignore_eos=args.ignore_eos, return_token_ids=args.return_token_ids, extra_body=args.extra_body)
    load = given(request_rates=args.request_rate, burstiness=args.burstiness,
                 max_concurrency=args.max_concurrency, warmup=args.warmup, duration_s=args.duration,
                 arrival=args.arrival or ("trace" if args.workload == "trace" and not args.request_rate else None))
    try:
        return BenchConfig.model_validate(given(
            target=target, workload={"kind": args.workload, **workload}, load=load, slo=args.slo,
            output_dir=args.output_dir, label=args.label, progress=not args.no_progress))
    except ValidationError as exc:
        raise UsageError(_problems(exc)) from None


def _problems(exc) -> str:
    flags = {"target": TARGET_FLAGS, "workload": WORKLOAD_FLAGS, "load": LOAD_FLAGS}
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        if loc and loc[0] in flags:
            field = next((p for p in loc[1:] if p in flags[loc[0]]), None)
            where = flags[loc[0]].get(field) if field else None
        else:
            where = OTHER_FLAGS.get(loc[0]) if loc else None
        problems.append(f"{where}: {msg}" if where else msg)
    return f"invalid bench settings: {'; '.join(problems)}"


def run(args: argparse.Namespace, cfg) -> int:
    from loadtest import report
    from loadtest.compare import print_comparison

    if args.bench_command == "compare":
        a, b = report.load(Path(args.a)), report.load(Path(args.b))
        print_comparison(a, b, a.get("label") or args.a, b.get("label") or args.b)
        return 0
    if args.bench_command == "report":
        result = report.load(Path(args.result))
        print(report.write_html(result, Path(args.output_dir or Path(args.result).parent)))
        return 0

    from rich.console import Console

    from loadtest.runner import run_benchmark

    result = asyncio.run(run_benchmark(cfg))
    json_path = report.write_json(result, cfg.output_dir / "result.json")
    html_path = report.write_html(result, cfg.output_dir)
    Console().print(report.summary_table(result))
    print(f"wrote {json_path} and {html_path}")
    return 0
