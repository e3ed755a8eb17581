"""Where one query's time goes between the client and the model, on this machine's CPU.

    python load/bench_query_path.py      # writes load/results/query-path-cpu-<date>.{json,md}

A one-layer random BERT (hidden 32) keeps the forward small, so the rest of the path shows:
`Info` is a unary gRPC round trip that never reaches a worker (the gRPC floor); each Embed answer
carries queue_us (admission to batch start: the request ring and the worker's wake-up) and
inference_us (the worker's batch), and the engine alone is timed in this process.
"""
from __future__ import annotations

import datetime
import pathlib
import platform
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
from load.results_file import write_results  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from pollen.worker.engine import EagerEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

N = 300


def p50_us(samples) -> float:
    return round(float(np.percentile(samples, 50)), 1)


def main() -> int:
    import transformers as tf

    model_dir = pathlib.Path(tempfile.mkdtemp(prefix="pollen-micro-"))
    torch.manual_seed(0)
    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=1000, max_position_embeddings=128)).save_pretrained(str(model_dir))
    write_tokenizer(str(model_dir), 1000)
    seq = np.arange(16, dtype=np.int32) + 5

    torch.set_num_threads(1)
    engine = EagerEngine(load_model(str(model_dir)))
    times = []
    for i in range(N + 30):
        t = time.perf_counter()
        engine.submit(pack([seq])).result()
        if i >= 30:
            times.append((time.perf_counter() - t) * 1e6)
    result = {"date": datetime.date.today().isoformat(), "device": machine(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__},
              "engine_alone_p50_us": p50_us(times)}

    server = ServerProcess("--model", str(model_dir), "--worker-threads", "1", "--http-listen", "").start(timeout=60)
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
    finally:
        server.terminate()
    result.update(embed_p50_us=p50_us(e2e), info_p50_us=p50_us(floor), queue_p50_us=p50_us(queue),
                  inference_p50_us=p50_us(inference))
    rest = result["embed_p50_us"] - result["info_p50_us"] - result["queue_p50_us"] - result["inference_p50_us"]
    rows = [("Embed round trip (16 token ids)", result["embed_p50_us"]),
            ("Info round trip (the gRPC floor)", result["info_p50_us"]),
            ("queue_us: admission to batch start", result["queue_p50_us"]),
            ("inference_us: the worker's batch", result["inference_p50_us"]),
            ("engine alone, in process", result["engine_alone_p50_us"]),
            ("the rest (frontend request and answer paths)", round(rest, 1))]
    table = "\n".join(["| part | p50 µs |", "| --- | ---: |", *(f"| {a} | {b} |" for a, b in rows)])
    header = (f"# One query's path on the CPU, {result['date']}\n\n{result['device']}; python "
              f"{result['versions']['python']}, torch {torch.__version__}, grpcio {grpc.__version__}; a one-layer "
              f"random BERT (hidden 32), one worker thread. Command: `python load/bench_query_path.py`.\n\n")
    print(table)
    write_results(str(REPO / "load" / "results"), f"query-path-cpu-{result['date']}", result, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
