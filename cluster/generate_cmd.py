"""`brigade generate`: run prompts through one in-process engine and print the results.

All inputs are checked before any token is generated: flags and the prompts file before the
model loads, prompt lengths and token ids right after. Then every prompt goes to the engine's
continuous batcher at once, and outputs are printed in input order.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.cli import UsageError
from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.sampling import InvalidRequest
from router.request_fields import sampling_params, token_ids

FILE_OVERRIDES = ("max_tokens", "temperature", "seed")
FILE_KEYS = ("prompt", "prompt_ids", *FILE_OVERRIDES)
EXAMPLE_LINE = '{"prompt": "Hello"}'


@dataclass(frozen=True)
class PromptSpec:
    prompt: str | list[int]
    params: SamplingParams
    line: str | None = None  # "F.jsonl line 3" for prompts from a file, named in errors


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)
    if args.prompts_file:
        specs = read_prompts_file(args.prompts_file, base)
    else:
        specs = [PromptSpec(args.prompt if args.prompt is not None else args.prompt_ids, base)]
    if args.chat and any(not isinstance(s.prompt, str) for s in specs):
        where = next(s.line for s in specs if not isinstance(s.prompt, str)) or "--prompt-ids"
        raise UsageError(f"{where}: --chat needs a text prompt, not token ids; drop --chat or send text")

    engine = LLMEngine(config)
    prompts = [_prompt_token_ids(engine, s, args.chat) for s in specs]
    start = time.perf_counter()
    show_progress = bool(args.prompts_file) and not args.json and sys.stderr.isatty()
    outputs = engine.generate(prompts, [s.params for s in specs], progress=show_progress)
    elapsed = time.perf_counter() - start
    engine.close()

    for out in outputs:
        print(json.dumps(as_json(out), ensure_ascii=False) if args.json else out.text)
    if not args.json:
        print(_summary(outputs, elapsed), file=sys.stderr)
    return 0


def read_prompts_file(name: str, base: SamplingParams) -> list[PromptSpec]:
    """Parse a JSONL prompts file ('-' is stdin); every problem names its line."""
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read prompts file {name}: {reason}; check the path "
                         "(a UTF-8 JSONL file)") from None
    specs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg}); each line must be an object "
                             f"like {EXAMPLE_LINE}") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object like {EXAMPLE_LINE}, got {line.strip():.40}")
        unknown = sorted(set(obj) - set(FILE_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(FILE_KEYS)}")
        if ("prompt" in obj) == ("prompt_ids" in obj):
            raise UsageError(f'{where}: needs exactly one of "prompt" (text) or "prompt_ids" (token ids)')
        try:
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise InvalidRequest("prompt", f"must be a string, got {obj['prompt']!r:.40}")
            prompt = obj["prompt"] if "prompt" in obj else token_ids(obj["prompt_ids"], "prompt_ids")
            specs.append(PromptSpec(prompt, sampling_params(obj, base, FILE_OVERRIDES), where))
        except InvalidRequest as exc:
            raise UsageError(f"{where}: {exc}; fix that line") from None
    if not specs:
        raise UsageError(f"prompts file {name} has no prompts; add lines like {EXAMPLE_LINE}")
    return specs


def _prompt_token_ids(engine: LLMEngine, spec: PromptSpec, chat: bool) -> list[int]:
    """Tokenize (through the chat template with --chat) and check the prompt fits this model."""
    try:
        prompt = spec.prompt
        if chat:
            if engine.tokenizer is None:
                raise InvalidRequest("prompt", "this model has no tokenizer.json, so no chat template")
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = engine.tokenize(prompt)
        engine.validate(ids, spec.params)
        return ids
    except InvalidRequest as exc:
        if spec.line is None:
            raise  # the error edge names the flag to change
        raise UsageError(f"{spec.line}: {exc}; fix that line") from None


def as_json(out: RequestOutput) -> dict:
    usage = dataclasses.asdict(out.usage)
    if not out.usage.spec_steps:  # the speculative counters only when speculation ran
        usage = {k: v for k, v in usage.items() if not k.startswith("spec_")}
    return {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason, "usage": usage}


def _summary(outputs: list[RequestOutput], elapsed: float) -> str:
    prompt = sum(o.usage.prompt_tokens for o in outputs)
    completion = sum(o.usage.completion_tokens for o in outputs)
    cached = sum(o.usage.cached_tokens for o in outputs)
    head = f"{len(outputs)} prompts: " if len(outputs) > 1 else ""
    reason = f"; finish_reason={outputs[0].finish_reason}" if len(outputs) == 1 else ""
    return (f"[{head}{prompt} prompt + {completion} completion tokens ({cached} cached){reason}; "
            f"{elapsed:.2f} s, {completion / max(elapsed, 1e-9):.1f} tok/s]")
