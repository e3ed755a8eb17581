"""GET /metrics after traffic through both doors: the per-door counters moved by exactly that traffic."""
from __future__ import annotations

import http.client
import json

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pollen.v1 import embedder_pb2 as pb


def scrape(server) -> dict[tuple, float]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/metrics")
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type").startswith("text/plain")
    text = reply.read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def http_post(server, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", "/v1/embeddings", body=json.dumps(body))
    status = conn.getresponse().status
    conn.close()
    return status


def test_counters_move_by_the_traffic(server, stub):
    grpc_texts = [["one", "two", "three"], ["four"]]
    stream_texts = [["five", "six"], ["seven"], ["eight", "nine", "ten"]]
    http_texts = ["eleven", "twelve"]
    tokens = lambda texts: stub.Tokenize(pb.TokenizeRequest(texts=texts)).usage.prompt_tokens  # noqa: E731

    before = scrape(server)
    for texts in grpc_texts:
        stub.Embed(pb.EmbedRequest(texts=texts), timeout=60)
    with pytest.raises(grpc.RpcError):
        stub.Embed(pb.EmbedRequest(texts=[""]), timeout=60)
    messages = [pb.EmbedRequest(id=str(i), texts=t) for i, t in enumerate(stream_texts)]
    messages.append(pb.EmbedRequest(id="bad", texts=[]))
    answers = list(stub.EmbedStream(iter(messages), timeout=60))
    assert sum(a.HasField("error") for a in answers) == 1
    assert http_post(server, {"input": http_texts}) == 200
    assert http_post(server, {"input": []}) == 400
    assert http_post(server, {"input": 3}) == 400
    after = scrape(server)

    all_grpc = [t for batch in grpc_texts + stream_texts for t in batch]
    assert delta(before, after, "pollen_requests_total", door="grpc", outcome="ok", task="embed") == 5
    assert delta(before, after, "pollen_requests_total", door="grpc", outcome="INVALID_ARGUMENT", task="embed") == 2
    assert delta(before, after, "pollen_texts_total", door="grpc", task="embed") == len(all_grpc)
    assert delta(before, after, "pollen_tokens_total", door="grpc", task="embed") == tokens(all_grpc)
    assert delta(before, after, "pollen_requests_total", door="http", outcome="ok", task="embed") == 1
    assert delta(before, after, "pollen_requests_total", door="http", outcome="INVALID_ARGUMENT", task="embed") == 2
    assert delta(before, after, "pollen_texts_total", door="http", task="embed") == 2
    assert delta(before, after, "pollen_tokens_total", door="http", task="embed") == tokens(http_texts)
    # The other families are exposed (filled by the worker pool), so dashboards can rely on them.
    names = {name for name, _ in after}
    assert {"pollen_queued_tokens", "pollen_worker_restarts_total", "pollen_queue_seconds_count"} <= names
    # The worker's own figures, from the server state: its batches moved; a CPU engine has no graphs.
    assert delta(before, after, "pollen_worker_batches_total", worker="0") >= 1
    for name in ("pollen_worker_eager_batches_total", "pollen_worker_padded_batches_total", "pollen_worker_graphs"):
        assert after[(name, (("worker", "0"),))] == 0


def test_http_client_leaving_cancels_its_request(server):
    import socket
    import time

    before = scrape(server)
    body = json.dumps({"input": ["a text long enough to keep the worker busy " * 20] * 64, "truncate": "end"}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    # The socket is closed before any answer: the door sees EOF and cancels the request.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = scrape(server)
        if delta(before, after, "pollen_requests_total", door="http", outcome="CANCELLED", task="embed") == 1:
            break
        time.sleep(0.2)
    assert delta(before, after, "pollen_requests_total", door="http", outcome="CANCELLED", task="embed") == 1
    assert delta(before, after, "pollen_requests_total", door="http", outcome="ok", task="embed") == 0
