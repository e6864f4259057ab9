"""Generated protobuf and gRPC modules for brigade.v1 (committed; see tools/gen_proto.py)."""
