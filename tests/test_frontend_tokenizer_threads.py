"""A frontend tokenizes with the tokenizers library on its event loop and its --tokenizer-threads,
never on that library's own thread pool (server/process/supervisor.py FRONTEND_ENV), unless the user's
environment turns that pool on: counted as the threads a real frontend gains while it serves.
The servers here run with --tokie off, so that every text goes to the tokenizers library
(tokie, on by default, encodes a group of texts on a pool of its own: server/pipeline/tokie_ids.py)."""
from __future__ import annotations

import os

import grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_frontends import frontend_pids


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def threads_gained_while_serving(parallelism: str | None) -> int:
    server = ServerProcess("--tokenizer-threads", "1", "--tokie", "off", "--log-level", "WARNING")
    if parallelism is None:
        server.env.pop("TOKENIZERS_PARALLELISM", None)  # the library's default: its pool on
    else:
        server.env["TOKENIZERS_PARALLELISM"] = parallelism
    server.start()
    try:
        pid = frontend_pids(server)[0]
        before = thread_count(pid)
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            for i in range(5):  # queries: tokenized on the event loop
                stub.Embed(pb.EmbedRequest(texts=[f"query {i} about sourdough"]), timeout=30)
            # over 2,048 characters: tokenized on the tokenizer thread
            stub.Embed(pb.EmbedRequest(texts=["word " * 1000, "x"], truncate=pb.TRUNCATE_END), timeout=30)
        return thread_count(pid) - before
    finally:
        server.kill()


def test_the_frontend_keeps_the_tokenizer_library_pool_off_by_default():
    # At most the one tokenizer thread; the library's pool would add one thread per core.
    assert threads_gained_while_serving(None) <= 1


def test_a_users_tokenizers_parallelism_is_kept():
    # The same requests with the user's TOKENIZERS_PARALLELISM=true: the library's pool starts.
    assert threads_gained_while_serving("true") >= 2
