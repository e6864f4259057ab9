"""`brigade-client`: talk to a Brigade server from the terminal."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from brigade_client.client import Client
from brigade_client.errors import BrigadeError

EXAMPLES = """examples:
  brigade-client generate --target 127.0.0.1:50051 "The capital of France is"
  brigade-client generate --target 127.0.0.1:50051 --max-tokens 64 --temperature 0 "Once upon a time"
  BRIGADE_TOKEN=... brigade-client generate --target host:50051 --tls --ca ca.pem "Hello"
  brigade-client models --target 127.0.0.1:50051
  brigade-client health --target 127.0.0.1:50051
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="brigade-client", description="Brigade gRPC client",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT (default %(default)s)")
    common.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca)")
    common.add_argument("--ca", metavar="PEM", help="CA certificate file for TLS")
    common.add_argument("--timeout", type=float, metavar="S", help="per-call timeout in seconds")
    common.add_argument("--token-env", default="BRIGADE_TOKEN", metavar="VAR",
                        help="env var holding the bearer token (default %(default)s; never a flag)")
    g = sub.add_parser("generate", parents=[common], help="stream a completion to the terminal",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--usage", action="store_true", help="print usage and timing as JSON to stderr at the end")
    sub.add_parser("models", parents=[common], help="list the served models")
    sub.add_parser("health", parents=[common], help="SERVING or NOT_SERVING")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    client = Client(args.target, token=os.environ.get(args.token_env) or None, tls=args.tls,
                    root_certificates=args.ca, timeout=args.timeout)
    try:
        with client:
            if args.command == "models":
                for m in client.models():
                    print(f"{m.id}\tmax_model_len={m.max_model_len}")
            elif args.command == "health":
                status = client.health()
                print(status)
                return 0 if status == "SERVING" else 1
            else:
                sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                            "top_k": args.top_k, "seed": args.seed, "stop": args.stop}
                for chunk in client.stream(args.prompt, **sampling):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
                sys.stdout.write("\n")
                if args.usage:
                    print(json.dumps({"finish_reason": last.finish_reason, "usage": dataclasses.asdict(last.usage),
                                      "timing": dataclasses.asdict(last.timing)}), file=sys.stderr)
    except BrigadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
