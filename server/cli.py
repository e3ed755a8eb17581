"""The `pollen` command. `pollen serve --help` lists every flag and its POLLEN_* variable."""
from __future__ import annotations

import logging
import os
import shutil
import sys

USAGE = """usage: pollen serve [flags]            serve embeddings over gRPC and HTTP (pollen serve --help)
       pollen embed TEXT... [flags]    embed texts with a running server (pollen embed --help)
       pollen rerank QUERY DOC... [flags]  rank documents with a running reranker (pollen rerank --help)
       pollen download MODEL [flags]   fetch a Hub model into the Hugging Face cache (pollen download --help)
       pollen bulk IN OUT [flags]      embed a Parquet corpus on Ray, no server (pollen bulk --help)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "embed":
        from pollen.client.command import main as embed  # the client side only: no torch, no server

        return embed(argv[1:])
    if argv[0] == "rerank":
        from pollen.client.rerank_command import main as rerank

        return rerank(argv[1:])
    if argv[0] == "download":
        return download(argv[1:])
    if argv[0] == "bulk":
        from pollen.bulk.command import main as bulk  # Ray and the engine in this process

        return bulk(argv[1:])
    if argv[0] != "serve":
        print(f"pollen: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return serve(argv[1:])


def serve(argv: list[str]) -> int:
    from pollen.server.config import ServeConfig

    try:
        cfg = ServeConfig.from_args(argv)
    except ValueError as exc:
        print(f"pollen serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Every process of this server counts its metrics here, for /metrics to sum (server/observe/metrics.py);
    # set before prometheus_client is imported, here and in the children that inherit it.
    # Named like a segment, so cleanup_stale_segments removes it after a kill -9 too.
    from pollen.shared_mem.segment import SHM_DIR, segment_name

    metrics_dir = os.path.join(SHM_DIR, segment_name())
    os.mkdir(metrics_dir, 0o700)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    import uvloop

    from pollen.server.process.app import serve as run_server

    try:
        uvloop.run(run_server(cfg, metrics_dir))
    except (ValueError, OSError, RuntimeError) as exc:
        logging.getLogger("pollen").error("%s", exc)
        return 1
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def download(argv: list[str]) -> int:
    """Fetch a Hub model's serving files into the Hugging Face cache (or find them there), check
    that pollen can serve them, and print the local directory. Exit 1 with one line when not."""
    import argparse

    from pollen.common import model_source
    from pollen.common.model_spec import TASK_CHOICES, check_tokenizer, read_model_spec

    parser = argparse.ArgumentParser(
        prog="pollen download", description="Fetch a model from the Hugging Face Hub into the Hugging Face cache "
        "(HF_HUB_CACHE, or $HF_HOME/hub), for `pollen serve --model ID` to start from it offline (HF_HUB_OFFLINE=1). "
        "Prints the model's local directory.")
    parser.add_argument("model", help="a Hub id, e.g. sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--task", default="auto", choices=TASK_CHOICES,
                        help="the task it will be served for, as pollen serve's --task (default: auto)")
    args = parser.parse_args(argv)
    try:
        path, _ = model_source.resolve(args.model, args.revision)
        # What pollen serve would refuse, refused now rather than on the air-gapped host.
        read_model_spec(path, task=args.task)
        check_tokenizer(path)
    except ValueError as exc:
        print(f"pollen download: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
