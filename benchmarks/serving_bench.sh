#!/usr/bin/env bash
# Serving benchmark: a rate sweep of the shared-prefix workload (`brigade bench run`) against
# `brigade serve` in disaggregated mode (P prefill + D decode workers) and in colocated mode
# (P + D mixed workers: the same number of workers), one server at a time on this machine.
#
# Writes OUT/disaggregated/{result.json,report.html,*.png}, OUT/colocated/..., OUT/comparison.txt
# (`brigade bench compare`, B = colocated over A = disaggregated), and benchmarks/results/
# serving_bench.json (machine, ratios disaggregated / colocated with targets, headline figures:
# goodput at the SLO, p99 TTFT and ITL per rate). --quick: a tiny sweep (under a minute on an idle
# machine) writing serving_bench.quick.json and OUT=benchmarks/results/serving_bench.quick.d.
#
# The model: SmolLM2-135M-Instruct (`smollm2-135m`, pulled and converted on first use) in both
# runs; --model tiny|bench picks a random-weight preset, or any registry name or checkpoint dir.
#
# usage: benchmarks/serving_bench.sh [--quick] [--model tiny|bench|NAME|PATH] [--rates 0.5,1,2,4]
#            [--slo ttft=4s,tpot=300ms] [--prefill 1] [--decode 1] [--device cpu|cuda]
#            [--groups 8] [--prompts-per-group 8] [--system-len 1024] [--question-len 64] [--output-len 64]
# The default SLO is for SmolLM2 in float32 on a 2-core CPU, whose decode step cannot beat ~84 ms (it reads
# 546 MB of weights; engine_bench's floor); the `bench` preset took ttft=2s,tpot=100ms; on a GPU pass e.g.
# --slo ttft=200ms,tpot=50ms.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

QUICK=0 MODEL=smollm2-135m RATES=0.5,1,2,4 SLO=ttft=4s,tpot=300ms PREFILL=1 DECODE=1 DEVICE=auto
NUM_GROUPS=8 PER_GROUP=8 SYSTEM_LEN=1024 QUESTION_LEN=64 OUTPUT_LEN=64 NUM_BLOCKS=2048
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --model) MODEL="$2"; shift ;;
    --rates) RATES="$2"; shift ;;
    --slo) SLO="$2"; shift ;;
    --prefill) PREFILL="$2"; shift ;;
    --decode) DECODE="$2"; shift ;;
    --device) DEVICE="$2"; shift ;;
    --groups) NUM_GROUPS="$2"; shift ;;
    --prompts-per-group) PER_GROUP="$2"; shift ;;
    --system-len) SYSTEM_LEN="$2"; shift ;;
    --question-len) QUESTION_LEN="$2"; shift ;;
    --output-len) OUTPUT_LEN="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1; run $0 --help" >&2; exit 2 ;;
  esac
  shift
done
NAME=serving_bench
if [ "$QUICK" = 1 ]; then
  NAME=serving_bench.quick RATES=8,inf SLO=ttft=5s,tpot=1s NUM_GROUPS=2 PER_GROUP=3
  SYSTEM_LEN=64 QUESTION_LEN=8 OUTPUT_LEN=8 NUM_BLOCKS=256
fi
# Pull a registry model once here, with its progress bar, rather than in each server's start-up.
"$PY" -c "import sys; from engine.presets import resolve_model; print('model:', resolve_model(sys.argv[1]))" "$MODEL"
OUT="$ROOT/benchmarks/results/$NAME$(if [ "$QUICK" = 1 ]; then echo .d; fi)"
mkdir -p "$OUT"

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

# start_server MODE WORKER_FLAGS...: starts `brigade serve`, sets URL once it prints its ready line.
start_server() {
  local mode="$1"; shift
  local log="$OUT/$mode.serve.log"
  "$PY" -m cluster.cli serve --mode "$mode" "$@" --model "$MODEL" --device "$DEVICE" \
      --num-blocks "$NUM_BLOCKS" --http-port 0 >"$log.out" 2>"$log" &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    URL="$(sed -n 's/^Brigade serving .* at \(http:[^ ]*\)\/v1 .*/\1/p' "$log.out")"
    [ -n "$URL" ] && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "error: brigade serve ($mode) exited; see $log" >&2; exit 1; }
    sleep 0.5
  done
  echo "error: brigade serve ($mode) not ready after 300 s; see $log" >&2; exit 1
}

run_mode() {
  local mode="$1"; shift
  echo "== $mode: brigade serve $* (model $MODEL), rates $RATES"
  start_server "$mode" "$@"
  "$PY" -m cluster.cli bench run --url "$URL" --label "$mode" --output-dir "$OUT/$mode" --no-progress \
      --workload shared-prefix --num-groups "$NUM_GROUPS" --prompts-per-group "$PER_GROUP" \
      --system-prompt-len "$SYSTEM_LEN" --question-len "$QUESTION_LEN" --output-len "$OUTPUT_LEN" \
      --request-rate "$RATES" --slo "$SLO" --warmup 2 --ignore-eos --return-token-ids --vocab-size 4096
  stop_server
}

run_mode disaggregated --prefill "$PREFILL" --decode "$DECODE"
run_mode colocated --decode "$((PREFILL + DECODE))"
"$PY" -m cluster.cli bench compare "$OUT/disaggregated/result.json" "$OUT/colocated/result.json" \
    | tee "$OUT/comparison.txt"
"$PY" "$ROOT/benchmarks/_serving_summary.py" "$NAME" "$OUT" "$MODEL"
