"""The `brigade` command line: the parser, the one flags -> EngineConfig mapping, the error edge.

Every bad input ends here as one line on stderr, `error: <what> ; <what to do>`, and exit
code 2 — never a traceback. Subcommands live in their own modules and raise the engine's
exception types (or UsageError) freely.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn

DESCRIPTION = "Brigade: serve and run LLMs (prefill and decode on separate workers)."
EPILOG = """\
examples:
  brigade generate --prompt "The capital of France is"      # greedy, built-in 'tiny' preset
  brigade generate --model smollm2-135m --prompt "What is the capital of France?" --chat   # a real model
  brigade generate --model ~/models/Qwen3-0.6B --prompt "Hi" --chat --max-tokens 64
  brigade serve --prefill 1 --decode 1 --http-port 8000   # OpenAI-compatible HTTP API on a Ray cluster
  brigade bench run --url http://127.0.0.1:8000 --workload shared-prefix --request-rate 1,2,4   # load test
  brigade models list                                       # real models: pull, verify, convert

Run 'brigade <command> --help' for a command's flags.
"""
GENERATE_EPILOG = """\
Sampling is greedy by default (--temperature 0), so the same command prints the same text;
pass --temperature 1.0 (and --seed) to sample.

examples:
  brigade generate --prompt "Once upon a time" --max-tokens 32
  brigade generate --prompt-ids 1,2,3 --max-tokens 5 --json
  brigade generate --prompt "Write a haiku" --chat --temperature 0.8 --seed 7 --stop "\\n\\n"
  brigade generate --prompts-file prompts.jsonl --json > outputs.jsonl

prompts file (JSONL, one request a line; outputs come back in input order):
  {"prompt": "Hello"}
  {"prompt_ids": [1, 2, 3], "max_tokens": 8}
  {"prompt": "Tell me a story", "temperature": 0.7, "seed": 1}
"""
SERVE_EPILOG = """\
Starts a local Ray (or joins one with --ray-address), an embedded redis-server on 127.0.0.1
(unless --redis-url), the router and the workers, then serves until Ctrl-C or SIGTERM, which
drain requests in flight and exit 0. If the router actor, or a local Ray's GCS or raylet, dies
meanwhile it says which, stops everything and exits 3 (a dead embedded redis-server is started
again: Redis holds hints only; a dead worker is replaced). Settings come from --config (YAML,
the same fields as the flags; see cluster.example.yaml), then from the flags, which win. The resolved config is
printed first; the line 'Brigade serving ... at http://HOST:PORT/v1' says it is ready.

examples:
  brigade serve                                   # tiny preset, 1 prefill + 1 decode, http://127.0.0.1:8000
  brigade serve --prefill 2 --decode 2 --http-port 9000
  brigade serve --mode colocated --decode 2       # 2 mixed workers (prefill + decode in one engine)
  brigade serve --prefill-tp 1 --decode-tp 2      # each decode worker: 2 tensor-parallel ranks
  brigade serve --config cluster.yaml --num-blocks 4096    # a config file, one field overridden
  brigade serve --config cluster.yaml --check     # validate it, print the resolved config, start nothing
  brigade serve --ray-address 10.0.0.5:6379 --redis-url redis://10.0.0.6:6379/0   # join a running Ray cluster
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Hello", "max_tokens": 16}'
"""

# Config fields (pydantic error locations) and request fields -> the flag that sets them.
SERVE_FLAGS = {
    ("model",): "--model", ("prefill",): "--prefill", ("decode",): "--decode", ("mode",): "--mode",
    ("ray_address",): "--ray-address", ("redis_url",): "--redis-url", ("host",): "--host",
    ("http_port",): "--http-port", ("grpc_port",): "--grpc-port", ("num_cpus",): "--num-cpus",
    ("drain_s",): "--drain-s", ("engine", "dtype"): "--dtype", ("engine", "quantization"): "--quantization",
    ("engine", "device"): "--device", ("engine", "speculative"): "--speculative",
    ("engine", "cache", "block_size"): "--block-size", ("engine", "cache", "num_blocks"): "--num-blocks",
    ("engine", "scheduler", "max_num_batched_tokens"): "--max-num-batched-tokens",
    ("engine", "scheduler", "max_num_seqs"): "--max-num-seqs", ("engine", "max_model_len"): "--max-model-len",
    ("engine", "cache", "hicache", "enabled"): "--hicache",
    ("engine", "cache", "hicache", "host_bytes"): "--hicache-host-bytes",
    ("engine", "cache", "hicache", "disk_dir"): "--hicache-disk-dir",
    ("engine", "cache", "hicache", "disk_bytes"): "--hicache-disk-bytes",
    ("router", "policy"): "--policy", ("index", "key_prefix"): "--redis-prefix",
    ("parallel", "prefill_tp"): "--prefill-tp", ("parallel", "decode_tp"): "--decode-tp",
    ("parallel", "decode_ep"): "--decode-ep",
}
CONFIG_FLAGS = {
    ("model",): "--model", ("dtype",): "--dtype", ("quantization",): "--quantization",
    ("device",): "--device", ("seed",): "--seed", ("speculative",): "--speculative",
    ("cache", "block_size"): "--block-size", ("cache", "num_blocks"): "--num-blocks",
    ("scheduler", "max_num_batched_tokens"): "--max-num-batched-tokens",
    ("cache", "hicache", "enabled"): "--hicache", ("cache", "hicache", "host_bytes"): "--hicache-host-bytes",
    ("cache", "hicache", "disk_dir"): "--hicache-disk-dir", ("cache", "hicache", "disk_bytes"): "--hicache-disk-bytes",
}
REQUEST_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed", "stop": "--stop",
    "prompt": "the prompt",
}


class UsageError(ValueError):
    """A bad input the CLI found itself; the message says what to do next."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage errors, as one line
        fail(f"{message}; run '{self.prog} --help' for usage")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")
    return value


def _engine_flags(defaults: bool = True) -> argparse.ArgumentParser:
    """Model and engine flags. Without `defaults` an absent flag is None, so that a config
    file's value is not overridden by a flag nobody gave."""
    from engine.presets import PRESETS
    from engine.registry.catalog import REGISTRY

    def default(value: str) -> str | None:
        return value if defaults else None

    parent = argparse.ArgumentParser(add_help=False)
    g = parent.add_argument_group("model and engine")
    g.add_argument("--model", default=default("tiny"), metavar="PATH|NAME",
                   help=f"HF-format checkpoint directory, a .gguf file, a registry model pulled on first use "
                        f"({', '.join(REGISTRY)}; see 'brigade models list') or a built-in preset "
                        f"({', '.join(PRESETS)}); default: tiny")
    g.add_argument("--dtype", default=default("auto"), choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto: the checkpoint's on CUDA; on CPU bfloat16 where the "
                        "CPU has bfloat16 dot-product instructions (avx512_bf16 / amx_bf16), else float32")
    g.add_argument("--quantization", default=default("none"), choices=["none", "int8", "int4", "gguf"],
                   help="weight-only quantization: int8 (per channel, at load), int4 (groups of 32, at "
                        "load; CPU only) or gguf (keep a GGUF checkpoint's Q4_0/Q4_1/Q8_0 blocks "
                        "quantized); activations run in bfloat16")
    g.add_argument("--device", default=default("auto"), type=_device, metavar="auto|cpu|cuda[:N]",
                   help="default: cuda when available, else cpu")
    g.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (default 16)")
    g.add_argument("--num-blocks", type=int, metavar="N",
                   help="KV blocks in the pool%s (default: 85%%%% of free GPU memory, or 256 MiB on CPU)"
                        % ("" if defaults else " of each worker"))
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="tokens per engine step (default 2048)")
    g.add_argument("--speculative", type=_speculative, metavar="draft=MODEL,k=4|ngram,k=4,n=3",
                   help="speculative decoding: a draft model with the target's vocabulary, or prompt lookup "
                        "(n-gram match in the prompt and output); also n_min, token_cost, max_batch, "
                        "draft_kv=ship|recompute, draft_quantization=int8|int4 (default: off; requests opt out "
                        "with speculate=false)")
    h = parent.add_argument_group("HiCache: host-memory and disk tiers under the KV pool (policies: config file)")
    h.add_argument("--hicache", action="store_true", default=None,
                   help="keep blocks the pool evicts in host memory (and on disk with --hicache-disk-dir) "
                        "and load them back on a prefix hit")
    h.add_argument("--hicache-host-bytes", type=int, metavar="B", help="host-memory tier budget (default 1 GiB)")
    h.add_argument("--hicache-disk-dir", metavar="DIR", help="disk tier directory, created 0700 (default: none)")
    h.add_argument("--hicache-disk-bytes", type=int, metavar="B", help="disk tier budget (default 8 GiB)")
    return parent


def _speculative(value: str) -> dict:
    """--speculative's text -> the whole engine.speculative section (it replaces the file's)."""
    from engine.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_flag(value).model_dump()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(value: str) -> list[int]:
    try:
        return [int(t) for t in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids like 1,2,3, got {value!r:.60}") from None


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="brigade", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    engine_flags = _engine_flags()

    gen = sub.add_parser("generate", parents=[engine_flags], formatter_class=fmt, epilog=GENERATE_EPILOG,
                         help="generate text for one prompt or a file of prompts",
                         description="Generate text for a prompt, or for a JSONL file of prompts "
                                     "batched together.")
    src = gen.add_argument_group("prompt (exactly one)").add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="a text prompt")
    src.add_argument("--prompt-ids", type=_int_list, metavar="1,2,3", help="a prompt as token ids")
    src.add_argument("--prompts-file", metavar="F.jsonl",
                     help='JSONL of {"prompt": ...} or {"prompt_ids": [...]}, optionally with '
                          '"max_tokens", "temperature", "seed"')
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate (default 16)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default) is greedy; 1.0 samples from the model's distribution")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1]; default 1")
    s.add_argument("--top-k", type=int, default=-1, metavar="K", help="keep the K likeliest tokens; -1: all")
    s.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P x the top probability; default 0")
    s.add_argument("--seed", type=int, metavar="S", help="makes sampled (temperature > 0) output repeatable")
    s.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    o = gen.add_argument_group("output")
    o.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template "
                                                       "as a user message")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (token_ids, text, finish_reason, usage)")
    gen.set_defaults(run="cluster.generate_cmd", make_config=engine_config)

    srv = sub.add_parser("serve", parents=[_engine_flags(defaults=False)], formatter_class=fmt,
                         epilog=SERVE_EPILOG, help="serve an OpenAI-compatible HTTP API from a Ray cluster",
                         description="Serve /v1/completions, /v1/models and /health from a router and "
                                     "prefill/decode workers on Ray.")
    c = srv.add_argument_group("cluster")
    c.add_argument("--config", metavar="FILE.yaml", help="cluster config file (YAML); flags override its fields")
    c.add_argument("--check", action="store_true",
                   help="only check the config file and flags (and that the token, password and certificate "
                        "files and env vars they name are there), print the resolved config, exit 0 (errors: 2)")
    c.add_argument("--prefill", type=int, metavar="N", help="prefill workers (default 1; 0 in colocated mode)")
    c.add_argument("--decode", type=int, metavar="M",
                   help="decode workers (default 1); in colocated mode, the number of mixed workers")
    c.add_argument("--mode", choices=["disaggregated", "colocated"],
                   help="disaggregated (default): prefill and decode on separate workers, KV moved "
                        "between them; colocated: each worker runs whole requests")
    c.add_argument("--prefill-tp", type=int, metavar="K", help="tensor-parallel ranks per prefill worker (default 1)")
    c.add_argument("--decode-tp", type=int, metavar="K",
                   help="tensor-parallel ranks per decode worker (default 1): K actors placed together")
    c.add_argument("--decode-ep", type=int, metavar="K",
                   help="expert-parallel ranks per decode worker, MoE models (default 1; with --decode-tp: equal)")
    c.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (default: start Ray locally)")
    c.add_argument("--front-only", action="store_const", const="front", dest="role",
                   help="an extra front (config role: front): doors and a router over the workers another "
                        "`brigade serve` owns on --ray-address, sharing its --redis-url; starts no worker")
    c.add_argument("--redis-url", metavar="URL",
                   help="Redis for worker leases and the prefix index, redis[s]://[USER:PASSWORD@]HOST:PORT/DB "
                        "(default: an embedded redis-server on 127.0.0.1, stopped on exit)")
    c.add_argument("--redis-prefix", metavar="PREFIX",
                   help="every Redis key starts with PREFIX: (default brigade); an ACL user limited to "
                        "~PREFIX:* is enough")
    c.add_argument("--policy", choices=["kv_aware", "least_loaded", "round_robin", "random"],
                   help="how the router picks workers (default kv_aware: lowest estimated TTFT from the "
                        "prefix index; the others ignore the index)")
    c.add_argument("--num-cpus", type=float, metavar="C", help="CPU cores the workers share (default: all)")
    c.add_argument("--drain-s", type=float, metavar="S",
                   help="on SIGTERM/SIGINT, how long requests in flight get to finish before the workers "
                        "stop anyway (default 30; the gRPC door gets 10 s more)")
    w = srv.add_argument_group("workers")
    w.add_argument("--max-num-seqs", type=int, metavar="N", help="requests a worker runs at once (default 128)")
    w.add_argument("--max-model-len", type=int, metavar="N",
                   help="context length (default: the model's max_position_embeddings)")
    h = srv.add_argument_group("network")
    h.add_argument("--host", help="address to listen on (default 127.0.0.1); one address, never a wildcard")
    h.add_argument("--http-port", type=int, metavar="P", help="default 8000; 0 picks a free one")
    h.add_argument("--grpc-port", type=int, metavar="P", help="the gRPC API's port (default 50051; 0 picks a free one; "
                   "grpc_port: null in --config turns it off)")
    srv.set_defaults(run="cluster.serve", make_config=cluster_config)

    from cluster.models_cmd import add_parser as add_models_parser
    from cluster.sim_cmd import add_parsers as add_sim_parsers
    from loadtest.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    add_models_parser(sub)
    add_sim_parsers(sub)
    return parser


def engine_config(args: argparse.Namespace):
    """The one place flags become an EngineConfig (validated by pydantic; errors name the flag)."""
    from engine.config import EngineConfig

    def given(**fields: Any) -> dict[str, Any]:
        return {k: v for k, v in fields.items() if v is not None}

    return EngineConfig.model_validate(given(
        model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        seed=getattr(args, "seed", None),
        cache=given(block_size=args.block_size, num_blocks=args.num_blocks, hicache=given(
            enabled=args.hicache, host_bytes=args.hicache_host_bytes, disk_dir=args.hicache_disk_dir,
            disk_bytes=args.hicache_disk_bytes)),
        scheduler=given(max_num_batched_tokens=args.max_num_batched_tokens),
        **given(speculative=args.speculative),
    ))


def cluster_config(args: argparse.Namespace):
    """The one place `serve` flags (over the --config file) become a ClusterConfig; every
    problem is named by its flag, or by its key and the file it came from."""
    from pydantic import ValidationError

    from cluster.config import load_config

    overrides = {
        "model": args.model, "prefill": args.prefill, "decode": args.decode, "mode": args.mode,
        "ray_address": args.ray_address, "redis_url": args.redis_url, "host": args.host, "role": args.role,
        "http_port": args.http_port, "grpc_port": args.grpc_port, "num_cpus": args.num_cpus, "drain_s": args.drain_s,
        "engine": {"dtype": args.dtype, "quantization": args.quantization, "device": args.device,
                   "max_model_len": args.max_model_len, "speculative": args.speculative,
                   "cache": {"block_size": args.block_size, "num_blocks": args.num_blocks,
                             "hicache": {"enabled": args.hicache, "host_bytes": args.hicache_host_bytes,
                                         "disk_dir": args.hicache_disk_dir, "disk_bytes": args.hicache_disk_bytes}},
                   "scheduler": {"max_num_batched_tokens": args.max_num_batched_tokens,
                                 "max_num_seqs": args.max_num_seqs}},
        "router": {"policy": args.policy}, "index": {"key_prefix": args.redis_prefix},
        "parallel": {"prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "decode_ep": args.decode_ep},
    }
    try:
        return load_config(args.config, overrides)
    except OSError as exc:
        raise UsageError(f"cannot read config file {args.config}: {exc.strerror or exc}; check the path") from None
    except ValidationError as exc:
        raise UsageError(_config_problems(exc, overrides, args.config)) from None
    except ValueError as exc:  # the file itself: not YAML, not a mapping
        raise UsageError(f"{exc}; see cluster.example.yaml for the format") from None


def _config_problems(exc, overrides: dict, path: str | None) -> str:
    from cluster.config import ClusterConfig

    problems = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc)
        msg = err["msg"].removeprefix("Value error, ")
        given: object = overrides
        for part in loc:
            given = given.get(part) if isinstance(given, dict) else None
        if err["type"] == "extra_forbidden":
            model = ClusterConfig
            for part in loc[:-1]:
                model = getattr(model.model_fields.get(part), "annotation", None) or model
            known = ", ".join(getattr(model, "model_fields", {}))
            problems.append(f"unknown key {key!r}{f' in {path}' if path else ''} (known here: {known})")
        elif given is not None and loc in SERVE_FLAGS:
            problems.append(f"{SERVE_FLAGS[loc]}: {msg}")
        elif loc:
            problems.append(f"{key}{f' (in {path})' if path else ''}: {msg}")
        else:
            problems.append(msg)
    return f"invalid cluster config: {'; '.join(problems)}"


def describe(exc: BaseException) -> str:
    """One line: what was wrong and what to do next."""
    from pydantic import ValidationError

    from engine.loader import CheckpointError
    from engine.model_config import UnsupportedModel
    from engine.presets import ModelNotFound
    from engine.sampling import InvalidRequest

    if isinstance(exc, ValidationError):
        problems = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            where = CONFIG_FLAGS.get(loc) or ".".join(loc)
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {msg}" if where else msg)
        return f"invalid settings: {'; '.join(problems)}; fix the flag(s) named"
    if isinstance(exc, InvalidRequest):
        return f"{exc}; change {REQUEST_FLAGS.get(exc.field, exc.field)}"
    if isinstance(exc, ModelNotFound):
        return f"{exc}; pass --model with a preset, a registry model, a .gguf file or a checkpoint directory"
    if isinstance(exc, UnsupportedModel):
        return f"{exc}; pick a checkpoint of a supported architecture, or --model tiny"
    if isinstance(exc, CheckpointError):
        return f"{exc}; re-download the checkpoint or point --model at a complete HF-format directory"
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"no such file: {exc.filename}; check the path"
    return str(exc)


def _user_errors() -> tuple[type[BaseException], ...]:
    from pydantic import ValidationError

    from engine.loader import CheckpointError
    from engine.model_config import UnsupportedModel
    from engine.presets import ModelNotFound
    from engine.sampling import InvalidRequest

    return (InvalidRequest, UnsupportedModel, CheckpointError, ModelNotFound, FileNotFoundError,
            ValidationError, ValueError)


def main(argv: list[str] | None = None) -> int:
    import importlib

    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(args.run).run(args, args.make_config(args))
    except _user_errors() as exc:
        fail(describe(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `brigade generate ... | head -1`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush stays quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
