"""pollen.client over replicas: calls spread round robin over real servers (a list, a
comma-separated string, a dns:/// name), and an embed_stream whose server is killed goes on
on the other one, every input answered once and in order."""
from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import numpy as np
import pytest

from pollen.client import AsyncClient, Client
from pollen.client.targets import channel_target
from tests.conftest import ServerProcess, free_port
from tests.texts import varied_texts

_OK = re.compile(r'^pollen_requests_total\{door="grpc",outcome="ok",task="embed"\} ([0-9.e+]+)$', re.M)


def answered(server: ServerProcess) -> int:
    """The gRPC requests this server answered, from its /metrics."""
    with urllib.request.urlopen(f"http://{server.http_listen}/metrics", timeout=30) as reply:
        found = _OK.search(reply.read().decode())
    return int(float(found.group(1))) if found else 0


def start_all(*servers: ServerProcess) -> list[ServerProcess]:
    """Start the servers side by side (each start is mostly waiting for its worker)."""
    errors = []

    def start(server):
        try:
            server.start(timeout=60)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.kill()
        raise errors[0]
    return list(servers)


@pytest.fixture(scope="module")
def pair():
    servers = start_all(ServerProcess(), ServerProcess())
    yield servers
    for s in servers:
        assert s.terminate() == 0


def spread(servers, send) -> list[int]:
    """How many gRPC requests each server answered while `send()` ran."""
    before = [answered(s) for s in servers]
    send()
    return [answered(s) - b for s, b in zip(servers, before)]


@pytest.mark.parametrize("form", ["list", "comma-separated"])
def test_calls_spread_over_a_list_of_replicas(pair, form):
    target = [s.listen for s in pair] if form == "list" else ",".join(s.listen for s in pair)
    with Client(target) as client:
        client.info()  # connects (to every replica: round_robin)
        vectors = []
        counts = spread(pair, lambda: vectors.extend(client.embed(f"text {i}") for i in range(40)))
    assert sum(counts) == 40 and min(counts) >= 10, counts  # round robin: about 20 each
    assert np.allclose(np.linalg.norm(np.concatenate(vectors), axis=1), 1, atol=1e-5)


def test_async_client_spreads_too(pair):
    async def main():
        async with AsyncClient([s.listen for s in pair]) as client:
            await client.info()
            return await asyncio.gather(*(client.embed(f"text {i}") for i in range(40)))

    counts = spread(pair, lambda: asyncio.run(main()))
    assert sum(counts) == 40 and min(counts) >= 5, counts


def test_target_forms():
    assert channel_target("dns:///pollen.search.svc:50051") == "dns:///pollen.search.svc:50051"
    assert channel_target("pollen:50051") == "pollen:50051"  # one name: gRPC resolves every address
    assert channel_target("127.0.0.1:1, localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(ValueError, match="mix IPv4-only and IPv6-only"):
        channel_target(["127.0.0.1:1", "[::1]:2"])
    with pytest.raises(ValueError, match="host:port"):
        channel_target(["127.0.0.1:1", "dns:///x:2"])


@pytest.mark.slow
def test_a_stream_goes_on_when_its_replica_dies():
    """Two servers on one port, 127.0.0.1 and ::1, behind the name localhost (as the pods of a
    headless Service behind its name): calls spread over both; then the server holding a stream
    is killed and the stream's unanswered messages go to the other."""
    port = free_port()
    servers = [ServerProcess(listen=f"127.0.0.1:{port}"), ServerProcess(listen=f"[::1]:{port}")]
    answers, killed = [], []
    try:
        start_all(*servers)
        texts = [t for t in varied_texts(160, seed=5) if len(t) < 400]
        with Client(f"dns:///localhost:{port}") as client:
            client.info()
            counts = spread(servers, lambda: [client.embed("warm") for _ in range(20)])
            assert sum(counts) == 20 and min(counts) >= 5, counts
            before = [answered(s) for s in servers]
            for vector in client.embed_stream(texts, in_flight=8):
                answers.append(vector)
                if len(answers) == 40:  # the stream's messages went to one server: kill that one
                    holder = max(range(2), key=lambda i: answered(servers[i]) - before[i])
                    servers[holder].kill()
                    killed.append(holder)
        survivor = servers[1 - killed[0]]
        with Client(survivor.listen) as direct:
            want = direct.embed(texts)
        assert answered(survivor) - before[1 - killed[0]] >= len(texts) - 40 - 8  # the rest came from it
    finally:
        for s in servers:
            s.kill()
    assert len(answers) == len(texts)  # each input answered once, in input order
    np.testing.assert_allclose(np.stack(answers), want, atol=1e-5)
