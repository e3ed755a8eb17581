"""`pollen rerank QUERY DOC...`: score documents against a query with a running server; JSON out."""
from __future__ import annotations

import argparse
import json
import sys

import grpc

from pollen.client.client import Client
from pollen.client.command import api_key, non_negative
from pollen.client.messages import EmbedError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pollen rerank", description="Rank documents against a query with a running pollen reranker.",
        epilog='JSON: {"model", "results": [{"index", "score"}, ...]}, best first; index is the document\'s '
               'position among DOC..., "model" the served reranker that answered.')
    p.add_argument("query", help="the query")
    p.add_argument("documents", nargs="*", help="documents to rank; '-' (or none) reads one a line from stdin")
    p.add_argument("--server", default="127.0.0.1:50051", help="gRPC address of the server [127.0.0.1:50051]")
    p.add_argument("--api-key", default=None, help="the server's API key [env POLLEN_API_KEY]")
    p.add_argument("--model", default="", help="the served reranker to ask [the server's first reranker]")
    p.add_argument("--top-n", type=non_negative, default=None, help="the best N only [every document]")
    p.add_argument("--instruction", default="", help="Qwen3-Reranker's task instruction [the model card's]")
    p.add_argument("--raw-scores", action="store_true", help="the logits, without the sigmoid")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    docs = args.documents if args.documents and args.documents != ["-"] else [line.rstrip("\n") for line in sys.stdin]
    try:
        with Client(args.server, timeout=args.timeout, api_key=api_key(args.api_key)) as client:
            results = client.rerank(args.query, docs, top_n=args.top_n, model=args.model,
                                    instruction=args.instruction, raw_scores=args.raw_scores)
    except EmbedError as exc:
        said = "" if exc.code == grpc.StatusCode.UNAVAILABLE else "the server answered "
        print(f"pollen rerank: {said}{exc}", file=sys.stderr)
        return 1
    json.dump({"model": results.model, "results": [{"index": i, "score": s} for i, s in results]}, sys.stdout)
    sys.stdout.write("\n")
    return 0
