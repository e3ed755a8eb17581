"""Several frontend processes in front of one worker: connections spread over them, every
request is answered once and correctly, the figures stay whole-server, and a frontend killed
with -9 comes back while the others keep serving."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import numpy as np

from pollen.server.observe.metrics import FLUSH_S
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, vectors
from tests.test_drops import sample, scrape

FRONTENDS = 3
CONNECTIONS = 12


def frontend_pids(server: ServerProcess) -> dict[int, int]:
    """{frontend index: pid} from the children's process titles."""
    pids = {}
    for pid in server.child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode()
        except (FileNotFoundError, ProcessLookupError):  # a child that died since child_pids (tests kill them)
            continue
        if title.startswith("pollen-frontend["):
            pids[int(title[len("pollen-frontend["):title.index("]")])] = pid
    return pids


def channels(target: str) -> list[grpc.aio.Channel]:
    # A distinct argument per channel keeps gRPC from sharing one connection between them.
    return [grpc.aio.insecure_channel(target, options=[("pollen.test.connection", i)]) for i in range(CONNECTIONS)]


async def embed_everywhere(target: str, texts: list[str]) -> tuple[list, set[int]]:
    chans = channels(target)
    try:
        stubs = [pb_grpc.EmbedderStub(c) for c in chans]
        infos = await asyncio.gather(*(s.Info(pb.InfoRequest(), timeout=30) for s in stubs))
        answers = await asyncio.gather(*(stubs[i % CONNECTIONS].Embed(
            pb.EmbedRequest(id=str(i), texts=[text], normalize=True), timeout=120) for i, text in enumerate(texts)))
        return answers, {info.frontend for info in infos}
    finally:
        await asyncio.gather(*(c.close() for c in chans))


def test_frontends_share_the_connections_and_answer_everything_once(reference):
    server = ServerProcess("--frontends", str(FRONTENDS), "--log-level", "WARNING").start()
    texts = [f"request {i} goes through one of several frontends" for i in range(150)]
    try:
        answers, served_by = asyncio.run(embed_everywhere(server.listen, texts))
        assert len(served_by) >= 2, served_by  # the kernel spread the connections over frontends
        assert [a.id for a in answers] == [str(i) for i in range(len(texts))]
        got = np.stack([vectors(a)[0] for a in answers])
        assert cosine_rows(got, reference(texts)).min() >= 0.9999
        # The scraped frontend writes its own counts out first; the others' wait at most
        # FLUSH_S in their memory (server/observe/metrics.py), so the sums are whole by then.
        time.sleep(FLUSH_S + 0.3)
        metrics = scrape(server)
        assert sample(metrics, "pollen_requests_total", door="grpc", outcome="ok", task="embed") == len(texts)
        assert sample(metrics, "pollen_sequences_total") == len(texts)
        assert sample(metrics, "pollen_queued_tokens") == 0
    finally:
        assert server.terminate() == 0


def listening_sockets(port: int) -> int:
    """TCP sockets in LISTEN on `port` (IPv4 and IPv6), from the kernel's tables."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                count += state == "0A" and int(local.rpartition(":")[2], 16) == port
    return count


def test_a_killed_frontend_comes_back_and_the_others_keep_serving(reference):
    server = ServerProcess("--frontends", str(FRONTENDS), "--log-level", "WARNING").start()
    texts = [f"text {i} while a frontend dies" for i in range(60)]
    try:
        # SERVING means started: every frontend listens on both doors (until then a frontend's
        # death fails the whole start, so health must not say SERVING before).
        assert listening_sockets(int(server.listen.rpartition(":")[2])) == FRONTENDS
        assert listening_sockets(server.http_port) == FRONTENDS
        before = frontend_pids(server)
        assert sorted(before) == list(range(FRONTENDS))
        os.kill(before[1], signal.SIGKILL)  # at once: health said SERVING, so the start is over
        # New connections land on the frontends that live; a call that met the dead one is UNAVAILABLE.
        got = []
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            for text in texts:
                for attempt in range(50):
                    try:
                        got.append(vectors(stub.Embed(pb.EmbedRequest(texts=[text], normalize=True), timeout=30))[0])
                        break
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                        time.sleep(0.1)
        assert cosine_rows(np.stack(got), reference(texts)).min() >= 0.9999
        deadline = time.monotonic() + 30
        while (after := frontend_pids(server)).get(1) in (None, before[1]) or len(after) < FRONTENDS:
            assert time.monotonic() < deadline, "the killed frontend did not come back"
            time.sleep(0.1)
        answers, served_by = asyncio.run(embed_everywhere(server.listen, texts))
        assert cosine_rows(np.stack([vectors(a)[0] for a in answers]), reference(texts)).min() >= 0.9999
        # Each health check lands on any frontend; the restarted one says SERVING once its worker's
        # READY has reached it, which on a loaded machine can trail its first answers a little.
        deadline = time.monotonic() + 10
        while not all(server.healthy() for _ in range(2 * FRONTENDS)):
            assert time.monotonic() < deadline, "the server is not SERVING after the frontend came back"
            time.sleep(0.2)
    finally:
        assert server.terminate() == 0


def frontends_reached(pairs) -> set[int]:
    """The frontend each of a client's connections is served by (Info says which)."""
    return {stub.Info(pb.InfoRequest(), timeout=30).frontend for _, stub in pairs}


def test_pollens_clients_spread_their_calls_over_the_frontends(reference):
    """One Client used from several threads, and one AsyncClient: their connections follow the
    server's frontend count and land on several frontends; every answer is right."""
    from concurrent.futures import ThreadPoolExecutor

    from pollen.client import AsyncClient, Client
    from pollen.client.connections import PER_FRONTEND

    server = ServerProcess("--frontends", str(FRONTENDS), "--log-level", "WARNING").start()
    texts = [f"query {i} from a client of several connections" for i in range(48)]
    try:
        with Client(server.listen) as client:
            assert len(client._connections.pairs) == 1  # until the server says how many frontends
            assert client.info().frontends == FRONTENDS
            assert len(client._connections.pairs) == PER_FRONTEND * FRONTENDS
            with ThreadPoolExecutor(8) as pool:
                got = np.concatenate(list(pool.map(client.embed, ([t] for t in texts))))
            assert cosine_rows(got, reference(texts)).min() >= 0.9999
        with Client(server.listen, connections=CONNECTIONS) as client:
            # 12 connections over 3 frontends all on one has odds of 3 in 3^12
            assert len(client._connections.pairs) == CONNECTIONS
            assert len(frontends_reached(client._connections.pairs)) >= 2
            client.info()
            assert len(client._connections.pairs) == CONNECTIONS  # a count given is kept

        async def use_async() -> np.ndarray:
            async with AsyncClient(server.listen) as aclient:
                await aclient.info()
                assert len(aclient._connections.pairs) == PER_FRONTEND * FRONTENDS
                return np.concatenate(await asyncio.gather(*(aclient.embed([t]) for t in texts)))

        assert cosine_rows(asyncio.run(use_async()), reference(texts)).min() >= 0.9999
        time.sleep(FLUSH_S + 0.3)  # every frontend's counts written out (server/observe/metrics.py)
        assert sample(scrape(server), "pollen_requests_total", door="grpc", outcome="ok", task="embed") == 2 * len(texts)
    finally:
        assert server.terminate() == 0
