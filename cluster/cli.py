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
  brigade generate --model ~/models/Qwen3-0.6B --prompt "Hi" --chat --max-tokens 64
  brigade serve --model tiny --http-port 8000               # OpenAI-compatible HTTP API

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
For now this serves one in-process engine; the multi-worker cluster replaces it.

examples:
  brigade serve                                   # tiny preset on http://127.0.0.1:8000
  brigade serve --model ~/models/Qwen3-0.6B --device cuda --http-port 9000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Hello", "max_tokens": 16}'
"""

# Config fields (pydantic error locations) and request fields -> the flag that sets them.
CONFIG_FLAGS = {
    ("model",): "--model", ("dtype",): "--dtype", ("device",): "--device", ("seed",): "--seed",
    ("cache", "block_size"): "--block-size", ("cache", "num_blocks"): "--num-blocks",
    ("scheduler", "max_num_batched_tokens"): "--max-num-batched-tokens",
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


def _engine_flags() -> argparse.ArgumentParser:
    from engine.presets import PRESETS

    parent = argparse.ArgumentParser(add_help=False)
    g = parent.add_argument_group("model and engine")
    g.add_argument("--model", default="tiny", metavar="PATH|PRESET",
                   help=f"HF-format checkpoint directory or built-in preset ({', '.join(PRESETS)}); "
                        "default: tiny")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto: the checkpoint's on CUDA, float32 on CPU")
    g.add_argument("--device", default="auto", type=_device, metavar="auto|cpu|cuda[:N]",
                   help="default: cuda when available, else cpu")
    g.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (default 16)")
    g.add_argument("--num-blocks", type=int, metavar="N",
                   help="KV blocks in the pool (default: 85%% of free GPU memory, or 1 GiB on CPU)")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="tokens per engine step (default 2048)")
    return parent


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
    gen.set_defaults(run="cluster.generate_cmd")

    srv = sub.add_parser("serve", parents=[engine_flags], formatter_class=fmt, epilog=SERVE_EPILOG,
                         help="serve an OpenAI-compatible HTTP API",
                         description="Serve /v1/completions, /v1/models and /health over HTTP.")
    h = srv.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    h.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                   help="default 8000; 0 picks a free one")
    srv.set_defaults(run="cluster.serve_local")
    return parser


def engine_config(args: argparse.Namespace):
    """The one place flags become an EngineConfig (validated by pydantic; errors name the flag)."""
    from engine.config import EngineConfig

    def given(**fields: Any) -> dict[str, Any]:
        return {k: v for k, v in fields.items() if v is not None}

    return EngineConfig.model_validate(given(
        model=args.model, dtype=args.dtype, device=args.device, seed=getattr(args, "seed", None),
        cache=given(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=given(max_num_batched_tokens=args.max_num_batched_tokens),
    ))


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
        return f"invalid engine settings: {'; '.join(problems)}; fix the flag(s) named"
    if isinstance(exc, InvalidRequest):
        return f"{exc}; change {REQUEST_FLAGS.get(exc.field, exc.field)}"
    if isinstance(exc, ModelNotFound):
        return f"{exc}; pass --model with a preset name or a checkpoint directory"
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
        return importlib.import_module(args.run).run(args, engine_config(args))
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
