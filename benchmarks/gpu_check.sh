#!/usr/bin/env bash
# The device check (benchmarks/_gpu_check.py, run as `python -m benchmarks._gpu_check`, says what it measures): one call of at most
# 7 minutes on a lent GPU machine, which has torch, numpy, safetensors, tokenizers,
# transformers, xxhash, jinja2 and pytest but no pydantic. Carry pydantic and its small
# dependencies as wheels in .whl/ (`make gpu-wheels` downloads them here); this script
# installs them from that folder, with no index, before running the check.
#   on the device:  benchmarks/gpu_check.sh            -> $OUT/gpu_check.json
#   anywhere (CI):  benchmarks/gpu_check.sh --cpu-smoke -> the same code paths on CPU, seconds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "pydantic is missing and .whl/ holds no wheels: run 'make gpu-wheels' and carry .whl" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/brigade-site .whl/*.whl
  export PYTHONPATH="/tmp/brigade-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 420 "$PYTHON" -m benchmarks._gpu_check --out "${OUT:-benchmarks/results}" "$@"
