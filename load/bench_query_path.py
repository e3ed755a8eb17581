"""Where one query's time goes between the client and the model.

    python load/bench_query_path.py      # writes load/results/query-path-cpu-<date>.{json,md}
    python load/bench_query_path.py --shape qwen3-0.6b --device cuda --tokenizer TOKENIZER.json \
        [--server-flags "--frontends 1"] --out load/results/STEM

By default a one-layer random BERT (hidden 32) keeps the forward small, so the rest of the path shows;
--shape takes a load/gpu_models.py shape instead (with the model family's real tokenizer). One
client, one call at a time, `pollen serve` defaults otherwise.
`Info` is a unary gRPC round trip that never reaches a worker (the gRPC floor); each Embed answer
carries queue_us (admission to batch start: the request ring and the worker's wake-up) and
inference_us (the worker's batch), and the engine alone is timed in this process.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import shlex
import sys
import tempfile
import time

import grpc
import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_grpc import machine  # noqa: E402
from load.gpu_models import write_tokenizer  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from pollen.worker.engine import EagerEngine, make_engine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

N = 300


def p50_us(samples) -> float:
    return round(float(np.percentile(samples, 50)), 1)


def p99_us(samples) -> float:
    return round(float(np.percentile(samples, 99)), 1)


def micro_bert() -> str:
    import transformers as tf

    model_dir = pathlib.Path(tempfile.mkdtemp(prefix="pollen-micro-"))
    torch.manual_seed(0)
    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=1000, max_position_embeddings=128)).save_pretrained(str(model_dir))
    write_tokenizer(str(model_dir), 1000)
    return str(model_dir)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, device and server flags of the one-query benchmarks (this one and bench_query_hops)."""
    p.add_argument("--shape", default="", help="a load/gpu_models.py shape (default: a one-layer micro BERT)")
    p.add_argument("--tokenizer", default="", help="with --shape: the model family's tokenizer.json")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-flags", default="", help="extra `pollen serve` flags")
    p.add_argument("--out", default="")


def query_model(args: argparse.Namespace) -> str:
    """The checkpoint folder: the --shape with its family's tokenizer, or the micro BERT."""
    if args.shape:
        from load.gpu_models import make_checkpoint, with_tokenizer

        return with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    return micro_bert()


def main() -> int:
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args()
    model_dir = query_model(args)
    seq = np.arange(16, dtype=np.int32) + 5
    text = "how do I keep a sourdough starter alive while on a two week holiday"

    if args.device == "cpu":
        torch.set_num_threads(1)
        flags = ["--worker-threads", "1"]
        engine = EagerEngine(load_model(model_dir))
    else:
        flags = []
        engine = make_engine(load_model(model_dir, device=args.device, dtype=torch.bfloat16), args.device,
                             max_batch_tokens=8192)
        engine.warm_up()
    times = []
    for i in range(N + 30):
        t = time.perf_counter()
        engine.submit(pack([seq])).result()
        if i >= 30:
            times.append((time.perf_counter() - t) * 1e6)
    result = {"date": datetime.date.today().isoformat(), "device": machine() if args.device == "cpu" else f"{torch.cuda.get_device_name()}, {machine()}",
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__},
              "engine_alone_p50_us": p50_us(times), "shape": args.shape or "micro-bert", "device_kind": args.device,
              "server_flags": args.server_flags}
    del engine
    if args.device != "cpu":
        torch.cuda.empty_cache()

    server = ServerProcess("--model", model_dir, "--device", args.device, *flags, "--http-listen", "",
                           *shlex.split(args.server_flags)).start(timeout=600)
    try:
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=seq.tolist())], normalize=True)
            for _ in range(50):
                stub.Embed(request)
            e2e, queue, inference, floor = [], [], [], []
            for _ in range(N):
                t = time.perf_counter()
                reply = stub.Embed(request)
                e2e.append((time.perf_counter() - t) * 1e6)
                queue.append(reply.timing.queue_us)
                inference.append(reply.timing.inference_us)
            for _ in range(N):
                t = time.perf_counter()
                stub.Info(pb.InfoRequest())
                floor.append((time.perf_counter() - t) * 1e6)
            as_text = pb.EmbedRequest(texts=[text], normalize=True)
            for _ in range(50):
                stub.Embed(as_text)
            texts = []
            for _ in range(N):
                t = time.perf_counter()
                stub.Embed(as_text)
                texts.append((time.perf_counter() - t) * 1e6)
    finally:
        server.terminate()
    result.update(embed_p50_us=p50_us(e2e), info_p50_us=p50_us(floor), queue_p50_us=p50_us(queue),
                  inference_p50_us=p50_us(inference), text_p50_us=p50_us(texts), text_p99_us=p99_us(texts),
                  embed_p99_us=p99_us(e2e))
    rest = result["embed_p50_us"] - result["info_p50_us"] - result["queue_p50_us"] - result["inference_p50_us"]
    rows = [("Embed round trip (16 token ids)", result["embed_p50_us"]),
            ("Info round trip (the gRPC floor)", result["info_p50_us"]),
            ("queue_us: admission to batch start", result["queue_p50_us"]),
            ("inference_us: the worker's batch", result["inference_p50_us"]),
            ("engine alone, in process", result["engine_alone_p50_us"]),
            ("the rest (frontend request and answer paths)", round(rest, 1)),
            (f"Embed round trip, one text ({text!r})", result["text_p50_us"])]
    table = "\n".join(["| part | p50 µs |", "| --- | ---: |", *(f"| {a} | {b} |" for a, b in rows)])
    model = (f"the {args.shape} shape, random weights, bf16" if args.shape
             else "a one-layer random BERT (hidden 32), one worker thread")
    header = (f"# One query's path on {args.device}, {result['date']}\n\n{result['device']}; python "
              f"{result['versions']['python']}, torch {torch.__version__}, grpcio {grpc.__version__}; {model}. "
              f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`. p99 of the round trips: "
              f"{result['embed_p99_us']:.0f} µs (token ids), {result['text_p99_us']:.0f} µs (text).\n\n")
    print(table)
    out = args.out or str(REPO / "load" / "results" / f"query-path-cpu-{result['date']}")
    write_results_to(out, result, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
