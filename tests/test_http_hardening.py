"""The HTTP door against clients that hold its resources: sockets that never send a byte (closed
after --http-first-byte-timeout, and closed first when the connection slots run out, so /health and
new clients are still answered), readers that never read their answers (the bytes held for them
are bounded per process by --http-unread-bytes), and malformed headers (refused 400 without
quoting them: a header can carry an API key)."""
from __future__ import annotations

import http.client
import json
import multiprocessing
import pathlib
import resource
import selectors
import socket
import time

import pytest

from pollen.server.config import FD_RESERVE
from tests.conftest import ServerProcess
from tests.test_frontends import frontend_pids
from tests.test_http_limits import queued, read_all, reset_by_peer
from tests.test_prompt_bounds import memory_mb, reset_peak

FIRST_BYTE_S = 2.0
PHASE_S = 3 * FIRST_BYTE_S  # each phase of the flood test: the flood's sockets are closed and opened again
FILL_S = 30.0  # the most the flood may take to fill every slot before a phase begins
PROBE_S = 0.05
BURST = 50
SECRET = "s3cr3t-0123456789"
# Connection slots: 512 (the default is 1,024), fewer where the open-files limit leaves no room
# for them and for the flood's own sockets in this process. The flood must hold every slot while
# the server closes each silent one after FIRST_BYTE_S: its one process reopens CAP sockets every
# FIRST_BYTE_S, which a loaded 2-core machine did not keep up with at 1,024.
CAP = min(512, resource.getrlimit(resource.RLIMIT_NOFILE)[1] // 2 - FD_RESERVE)
FLOOD_RSS_MB = 32     # what a frontend may grow by while CAP idle sockets come and go
UNREAD_BYTES = 2 << 20
READERS = 16          # each reader's answer about 1 MB: without the bound, about 16 MB held
UNREAD_WRITE_TIMEOUT_S = 6.0
UNREAD_RSS_MB = 12    # the bound above, an answer being encoded, and the allocator's slack


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the flood's sockets live in this process
    srv = ServerProcess("--api-key", SECRET, "--http-first-byte-timeout", str(FIRST_BYTE_S),
                        "--http-max-connections", str(CAP), log=str(log)).start()
    yield srv
    assert srv.terminate() == 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return read_all(sock)[0]


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\0\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization Bearer %s\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Api-Key: %s\r\r\n\r\n",
    b"GET /v1/models?key=%s\0 HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["nul-in-value", "no-colon", "cr-in-value", "nul-in-target"])
def test_a_malformed_header_is_400_and_never_quoted(guarded, request_bytes):
    received = exchange(guarded.http_port, request_bytes % SECRET.encode())
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), received
    assert SECRET.encode() not in received and b"Bearer" not in body, received
    message = json.loads(body)["error"]["message"]
    assert message.startswith("malformed request: ") and ("header" in message or "request line" in message), message
    assert SECRET not in pathlib.Path(guarded.log).read_text(errors="replace")


def test_a_connection_that_sends_nothing_is_closed_after_the_first_byte_timeout(guarded):
    kept = http.client.HTTPConnection("127.0.0.1", guarded.http_port, timeout=30)
    kept.request("GET", "/health")
    assert kept.getresponse().read() == b'{"status":"SERVING"}'
    with socket.create_connection(("127.0.0.1", guarded.http_port), timeout=30) as silent:
        t0 = time.monotonic()
        received, ending = read_all(silent)
        waited = time.monotonic() - t0
    assert received == b"" and ending == "closed"  # closed quietly: it asked for nothing
    assert FIRST_BYTE_S - 0.5 < waited < FIRST_BYTE_S + 3, waited
    # A connection that has been answered waits for its next request under the idle timeout.
    kept.request("GET", "/health")
    assert kept.getresponse().status == 200
    kept.close()


def crowd(port: int, idle: int, report) -> None:
    """Other clients, in a process of their own (so that they take no time from the measured
    client's), until the measuring process says stop: `idle` connections that send nothing, each
    opened again as soon as the server closes it (the attacker), and a new connection every PROBE_S
    that asks for /health (a liveness probe)."""
    sel = selectors.DefaultSelector()
    opened, statuses, ready = 0, [], False
    settled = time.monotonic() + (FIRST_BYTE_S / 2 if idle else 0)  # the slots fill up first
    next_probe = settled
    while not report.poll():
        if not ready and time.monotonic() >= settled:
            report.send("ready")
            ready = True
        for _ in range(min(idle - len(sel.get_map()), BURST)):  # no more at once than the accept queue holds
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            sel.register(sock, selectors.EVENT_READ)
            opened += 1
        for key, _ in sel.select(timeout=0.005):
            try:
                data = key.fileobj.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
        if time.monotonic() >= next_probe:
            next_probe += PROBE_S
            statuses.append(probe_health(port))
    report.send({"opened": opened, "statuses": statuses})


def probe_health(port: int) -> int | str:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except (OSError, http.client.HTTPException) as exc:
        return repr(exc)


def latencies(conn: http.client.HTTPConnection, n: int, path: str = "/v1/models") -> list[float]:
    """A well-behaved client on its own kept-alive connection, one request at a time: by default
    one the frontend answers alone (the flood is the frontend's to bear; a worker's time, shared
    with whatever else runs on the machine, would only add noise)."""
    body = json.dumps({"input": "a short query"}) if path == "/v1/embeddings" else None
    headers = {"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"}
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST" if body else "GET", path, body=body, headers=headers)
        reply = conn.getresponse()
        payload = reply.read()
        assert reply.status == 200, payload
        took.append(time.perf_counter() - t0)
    return took


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(len(samples) * 0.99)]


def sockets(pid: int) -> int:
    """The sockets a process holds open."""
    fds = pathlib.Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if _readlink(fd).startswith("socket:"))


def _readlink(path: pathlib.Path) -> str:
    try:
        return str(path.readlink())
    except FileNotFoundError:  # closed since the listing
        return ""


def phase(server: ServerProcess, conn: http.client.HTTPConnection, idle: int) -> tuple[list[float], dict]:
    """The measured client's latencies (and an embedding now and then) for PHASE_S while `crowd`
    runs; with idle sockets, from the moment they fill every slot of the frontend's (how long the
    crowd takes to get there depends on how busy the machine is, so that wait is not the phase's)."""
    frontend = frontend_pids(server)[0]
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    base = sockets(frontend)
    others = context.Process(target=crowd, args=(server.http_port, idle, theirs))
    others.start()
    assert ours.recv() == "ready"
    deadline = time.monotonic() + FILL_S
    while idle and sockets(frontend) < base + CAP - 2:
        assert time.monotonic() < deadline, f"the flood holds {sockets(frontend) - base} of {CAP} slots"
        time.sleep(0.05)
    took, until = [], time.monotonic() + PHASE_S
    while time.monotonic() < until:
        took += latencies(conn, 50)
        latencies(conn, 1, "/v1/embeddings")
    ours.send("stop")
    crowd_report = ours.recv()
    others.join(30)
    return took, crowd_report


@pytest.mark.slow
def test_idle_sockets_filling_every_slot_leave_health_and_clients_answered(guarded):
    frontend = frontend_pids(guarded)[0]
    good = http.client.HTTPConnection("127.0.0.1", guarded.http_port, timeout=30)
    latencies(good, 50)  # warm up
    quiet, calm = phase(guarded, good, 0)
    before = memory_mb(frontend)["VmRSS"]
    reset_peak(frontend)
    attacked, flood = phase(guarded, good, CAP)
    peak = memory_mb(frontend)["VmHWM"]
    again, _ = phase(guarded, good, 0)
    good.close()
    print(f"p99 quiet {p99(quiet) * 1e3:.2f} / {p99(again) * 1e3:.2f} ms, under the flood {p99(attacked) * 1e3:.2f} ms "
          f"({len(attacked)} requests); {flood['opened']} idle sockets; RSS {before} -> peak {peak} MB")
    assert set(calm["statuses"]) == {200}
    assert flood["opened"] > 2 * CAP, flood["opened"]  # every slot was taken, and taken again once closed
    refused = [s for s in flood["statuses"] if s != 200]
    assert len(flood["statuses"]) > 20 and not refused, refused[:5]
    assert peak - before < FLOOD_RSS_MB


@pytest.fixture(scope="module")
def unread_server():
    srv = ServerProcess("--http-unread-bytes", str(UNREAD_BYTES), "--http-write-timeout",
                        str(UNREAD_WRITE_TIMEOUT_S), "--openai-token-ids", "on").start()
    yield srv
    assert srv.terminate() == 0


# An answer of about 1 MB (float JSON) for little work: one-token sequences.
BIG_BODY = json.dumps({"input": [[100]] * 128}).encode()
BIG_REQUEST = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BIG_BODY), BIG_BODY)


def big_answer(conn: http.client.HTTPConnection) -> tuple[int, bytes, str | None]:
    conn.request("POST", "/v1/embeddings", body=BIG_BODY)
    reply = conn.getresponse()
    return reply.status, reply.read(), reply.getheader("Retry-After")


@pytest.mark.slow
def test_answers_nobody_reads_are_bounded_per_process(unread_server):
    frontend = frontend_pids(unread_server)[0]
    conn = http.client.HTTPConnection("127.0.0.1", unread_server.http_port, timeout=120)
    status, answer, _ = big_answer(conn)  # one answer read: the frontend's memory warmed up by it
    assert status == 200 and len(answer) > 1 << 20
    before = memory_mb(frontend)["VmRSS"]
    reset_peak(frontend)
    readers = []
    for _ in range(READERS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
        # A segment size of a real network's (loopback's is 64 KiB): the kernel then takes little of
        # the answer into its own buffers, and the rest waits in the server's.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1000)
        sock.connect(("127.0.0.1", unread_server.http_port))
        sock.sendall(BIG_REQUEST)
        readers.append(sock)
    deadline = time.monotonic() + 120
    while not all(queued(s) for s in readers):  # every request answered, or refused
        assert time.monotonic() < deadline, "the requests were not answered"
        time.sleep(0.05)
    peak = memory_mb(frontend)["VmHWM"]
    heads = [s.recv(16) for s in readers]
    held = [s for s, h in zip(readers, heads) if h.startswith(b"HTTP/1.1 200 ")]
    refused = [s for s, h in zip(readers, heads) if h.startswith(b"HTTP/1.1 503 ")]
    print(f"RSS {before} -> peak {peak} MB; {len(held)} answers held, {len(refused)} refused")
    assert len(held) + len(refused) == READERS, heads
    # Past the bound answers are refused; the kernel and the transports take a little of each held one.
    assert 1 <= len(held) <= 2 * UNREAD_BYTES // len(answer) and refused
    assert peak - before < UNREAD_RSS_MB
    time.sleep(0.2)
    rest = refused[0].recv(1 << 16)  # the refusal says when to come back, and names the bound
    assert b"Retry-After: 1" in rest and b"--http-unread-bytes" in rest, rest
    # While those answers are held, a new one of their size is refused too; once their readers
    # have been reset at the write timeout, the room is given back.
    status, _, retry = big_answer(conn)
    assert status == 503 and retry == "1"
    deadline = time.monotonic() + UNREAD_WRITE_TIMEOUT_S + 10
    while not all(reset_by_peer(s) for s in held):
        assert time.monotonic() < deadline, "the readers holding answers were not reset"
        time.sleep(0.1)
    status, answer, _ = big_answer(conn)
    assert status == 200 and len(answer) > 1 << 20
    conn.close()
    for sock in readers:
        sock.close()
