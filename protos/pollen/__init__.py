"""pollen wire API: generated protobuf and gRPC modules (see protos/generate.py)."""
