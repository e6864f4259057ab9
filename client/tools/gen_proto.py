"""Regenerate the committed gRPC/protobuf stubs from proto/ (needs grpcio-tools, a dev extra).

    python client/tools/gen_proto.py          # rewrite brigade_client/v1/*_pb2*.py(i)
    python client/tools/gen_proto.py --check  # exit 1 if the committed stubs are stale

The proto lives at proto/brigade/v1/ (its package is brigade.v1) but is compiled as
`brigade_client/v1/brigade.proto`, so the generated modules import each other through the
installed package (`from brigade_client.v1 import brigade_pb2`) rather than a top-level
`brigade` package of their own.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[1]
PROTO_DIR = CLIENT / "proto" / "brigade" / "v1"
OUT = CLIENT / "brigade_client" / "v1"
GENERATED = ("brigade_pb2.py", "brigade_pb2.pyi", "brigade_pb2_grpc.py")


def generate(out_root: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-Ibrigade_client/v1={PROTO_DIR}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *(str(p) for p in sorted(PROTO_DIR.glob("*.proto")))]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str]) -> int:
    if "--check" not in argv:
        generate(CLIENT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [name for name in GENERATED
                 if (Path(tmp) / "brigade_client" / "v1" / name).read_text() != (OUT / name).read_text()]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run python client/tools/gen_proto.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
