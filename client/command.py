"""`pollen embed`: vectors from a running server, printed as JSON or written as a .npy file."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import grpc
import numpy as np

from pollen.client.client import Client
from pollen.client.messages import EmbedError, ScaledInt8Array
from pollen.common import encodings

# The server words its refusals in the proto's names; the CLI names its own flags instead.
_FLAG_OF = {"TRUNCATE": "--truncate", "LONG_INPUT": "--long-input", "ENCODING": "--encoding",
            "PRIORITY": "--priority"}
_ENUM = r"(TRUNCATE|LONG_INPUT|ENCODING|PRIORITY)_([A-Z0-9_]+)"
_SET_ENUM = re.compile(rf"\bset (?:truncate|long_input|encoding|priority) to {_ENUM}((?: or {_ENUM})*)")
_BARE_ENUM = re.compile(rf"\b(?:truncate|long_input|encoding|priority) {_ENUM}\b|\b{_ENUM}\b")
# What `outputs` asks is this command's --sparse and --tokens (neither: the dense vectors).
_OUTPUT_FLAG = {"DENSE": "dense output", "SPARSE": "--sparse", "TOKENS": "--tokens"}
_OUTPUT = re.compile(r"\b(?:outputs )?OUTPUT_(DENSE|SPARSE|TOKENS)\b")


def _flag(kind: str, value: str) -> str:
    return f"{_FLAG_OF[kind]} {value.lower()}"


def cli_wording(message: str) -> str:
    """A server refusal with the proto's enum values as the CLI flags that set them
    ("set truncate to TRUNCATE_END or TRUNCATE_START": "pass --truncate end or --truncate start";
    "outputs OUTPUT_SPARSE": "--sparse")."""
    def setting(m: re.Match) -> str:
        values = [_flag(m.group(1), m.group(2))] + [_flag(k, v) for k, v in re.findall(_ENUM, m.group(3))]
        return "pass " + " or ".join(values)

    def bare(m: re.Match) -> str:
        kind, value = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return _flag(kind, value)
    message = _OUTPUT.sub(lambda m: _OUTPUT_FLAG[m.group(1)], message)
    return _BARE_ENUM.sub(bare, _SET_ENUM.sub(setting, message))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pollen embed", description="Embed texts with a running pollen server.",
        epilog="JSON: {\"model\", \"encoding\", \"embeddings\": one list per text, \"scales\" for int8}; with --tokens "
               "or --sparse: {\"model\", \"token_embeddings\" or \"sparse_embeddings\"}; \"model\" is the served "
               "model that answered. "
               "npy: a rows x dims array (ubinary: packed bytes); for int8 the scales go to <file>.scales.npy.")
    p.add_argument("texts", nargs="*", help="texts to embed; '-' (or none) reads one text per line from stdin")
    p.add_argument("--server", default="127.0.0.1:50051",
                   help="gRPC address of the server; replicas as host1:port,host2:port or dns:///name:port "
                        "[127.0.0.1:50051]")
    p.add_argument("--api-key", default=None,
                   help="the server's API key [env POLLEN_API_KEY, its first key when it lists several]")
    p.add_argument("--model", default="",
                   help="the served model to ask (Info's models) [the server's first embedding model]")
    p.add_argument("--format", choices=("json", "npy"), default="json", help="output format [json]")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.add_argument("--dimensions", type=non_negative, default=0, help="Matryoshka prefix length (0: the model's size)")
    p.add_argument("--encoding", choices=encodings.NAMES, default="float32")
    p.add_argument("--no-normalize", dest="normalize", action="store_false", help="keep the raw pooled vectors")
    p.add_argument("--truncate", choices=("none", "end", "start"), default=None,
                   help="too long texts: error (none), keep the start (end) or keep the end (start) "
                        "[the server's --default-truncate]")
    p.add_argument("--max-tokens", type=non_negative, default=0, help="tokens per text at most (0: the model's limit)")
    p.add_argument("--prompt-name", default="", help="a prompt the model defines, e.g. query")
    p.add_argument("--prompt", default="", help="a literal prefix for every text")
    p.add_argument("--long-input", choices=("truncate", "chunk_mean"), default="truncate")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--tokens", action="store_true",
                      help="each text's token vectors instead (JSON \"token_embeddings\": a list of vectors per text)")
    what.add_argument("--sparse", action="store_true",
                      help="a SPLADE or BGE-M3 model's sparse vectors instead (JSON \"sparse_embeddings\": "
                           "{indices, values} per text)")
    p.add_argument("--sparse-top-k", type=positive, default=None,
                   help="with --sparse: each text's largest weights kept")
    p.add_argument("--sparse-tokens", action="store_true",
                   help="with --sparse: each id's vocabulary token too (JSON \"tokens\" beside \"indices\")")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    return p


def sparse_json(ids, weights, tokens: list[str] | None = None) -> dict:
    """One text's sparse vector as the JSON output holds it (its tokens when asked)."""
    return {"indices": ids.tolist(), "values": weights.tolist(), **({"tokens": tokens} if tokens is not None else {})}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if not args.texts and sys.stdin.isatty():
        parser().print_usage(sys.stderr)
        return 2
    texts = args.texts if args.texts and args.texts != ["-"] else [line.rstrip("\n") for line in sys.stdin]
    if not texts:
        print("pollen embed: no texts given", file=sys.stderr)
        return 2
    if args.format == "npy" and args.output is None and sys.stdout.isatty():
        print("pollen embed: --format npy writes binary; give -o FILE or redirect stdout", file=sys.stderr)
        return 2
    if args.format == "npy" and args.output is None and args.encoding == "int8":
        print("pollen embed: int8 as npy needs -o FILE (the scales go to FILE.scales.npy); or use --format json",
              file=sys.stderr)
        return 2
    if (args.tokens or args.sparse) and args.format == "npy":
        print("pollen embed: --tokens and --sparse answer ragged rows: use --format json", file=sys.stderr)
        return 2
    stray = next((flag for flag, given in (("--sparse-top-k", args.sparse_top_k is not None),
                                           ("--sparse-tokens", args.sparse_tokens)) if given), None)
    if stray and not args.sparse:
        print(f"pollen embed: {stray} goes with --sparse", file=sys.stderr)
        return 2
    if args.output is not None and not writable(args.output):
        print(f"pollen embed: cannot write {args.output}", file=sys.stderr)
        return 2
    try:
        with Client(args.server, timeout=args.timeout, api_key=api_key(args.api_key)) as client:
            options = dict(dimensions=args.dimensions, normalize=args.normalize, encoding=args.encoding,
                           truncate=args.truncate, max_tokens=args.max_tokens, prompt_name=args.prompt_name,
                           prompt=args.prompt, long_input=args.long_input, model=args.model)
            if args.tokens:
                answer = client.embed_tokens(texts, **options)
                doc = {"token_embeddings": [rows.tolist() for rows in answer]}
            elif args.sparse:
                options.pop("dimensions")
                answer = client.embed_sparse(texts, sparse_top_k=args.sparse_top_k, sparse_tokens=args.sparse_tokens,
                                             **options)
                doc = {"sparse_embeddings": [sparse_json(*row) for row in answer]}
            else:
                answer = rows = client.embed(texts, **options)
            model = answer.model
    except EmbedError as exc:
        said = "" if exc.code == grpc.StatusCode.UNAVAILABLE else "the server answered "
        print(f"pollen embed: {said}{cli_wording(str(exc))}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"pollen embed: {exc}", file=sys.stderr)
        return 2
    if args.tokens or args.sparse:
        write_text(json.dumps({"model": model, **doc}) + "\n", args.output)
    elif args.format == "json":
        write_json(rows, model, args.encoding, args.output)
    else:
        write_npy(rows, args.output)
    return 0


def non_negative(text: str) -> int:
    """A whole number of at least 0 (argparse names the flag when it is not)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def writable(path: str) -> bool:
    """Whether `path` can be written: checked before the server's work is spent."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.access(path, os.W_OK) if os.path.exists(path) else os.path.isdir(folder) and os.access(folder, os.W_OK)


def api_key(flag: str | None) -> str | None:
    """--api-key, else POLLEN_API_KEY: the server's own variable may list several keys, comma-
    separated, and any of them will do, so the first is taken."""
    if flag is not None:
        return flag
    listed = [k.strip() for k in os.environ.get("POLLEN_API_KEY", "").split(",") if k.strip()]
    return listed[0] if listed else None


def write_json(rows: np.ndarray, model: str, encoding: str, output: str | None) -> None:
    doc = {"model": model, "encoding": encoding, "embeddings": rows.view(np.ndarray).tolist()}
    if isinstance(rows, ScaledInt8Array):
        doc["scales"] = rows.scales.tolist()
    write_text(json.dumps(doc) + "\n", output)


def write_text(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        with open(output, "w") as f:
            f.write(text)


def write_npy(rows: np.ndarray, output: str | None) -> None:
    if output is None:
        np.save(sys.stdout.buffer, rows.view(np.ndarray))
        sys.stdout.buffer.flush()
        return
    np.save(output, rows.view(np.ndarray))
    if isinstance(rows, ScaledInt8Array):
        np.save(output.removesuffix(".npy") + ".scales.npy", rows.scales)
