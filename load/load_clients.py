"""Closed-loop load from several client processes: N clients, each sending one query and waiting
for its answer before the next, over gRPC unary, gRPC streams or HTTP; latencies per call.

Each process runs its share of the clients on one asyncio loop (Python gRPC's client costs about
as much CPU per call as the server's frontend, so one process could not load several frontends),
over several connections, so that the kernel spreads them over the server's frontend processes.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time

import numpy as np

CONNECTIONS_PER_PROCESS = 16
# Kinds whose clients all share one gRPC connection from one process: a search service's one
# channel (a Go or Java client opens one), which reaches one frontend.
ONE_CONNECTION = {"unary-one-connection": "unary"}


def run(kind: str, target: str, http_target: str, clients: int, processes: int, texts: list[str],
        warm_s: float, seconds: float, priority: str = "interactive", watch: dict[str, list[int]] | None = None) -> dict:
    """Run `clients` closed-loop clients in `processes` processes; figures over the timed window.
    `watch` names groups of pids (the server's frontends, its workers) whose CPU use over the
    window is reported, in cores busy, beside the clients' own."""
    connections = CONNECTIONS_PER_PROCESS
    if kind in ONE_CONNECTION:
        kind, processes, connections = ONE_CONNECTION[kind], 1, 1
    processes = max(1, min(processes, clients))
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    start = time.time() + 1.5  # every process has started by then
    args = [(kind, target, http_target, n, texts[i::processes] or texts, start + warm_s, seconds, priority,
             connections) for i, n in enumerate(shares)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pending = pool.starmap_async(_process, args)
        busy = cores_busy(watch or {}, start + warm_s, seconds)
        parts = pending.get()
    latencies = np.concatenate([p["latencies"] for p in parts]) if parts else np.empty(0)
    errors = sum(p["errors"] for p in parts)
    ms = latencies * 1e3
    busy["clients"] = sum(p["cpu_s"] for p in parts) / seconds
    return {"clients": clients, "processes": processes, "completed": int(len(ms)), "errors": errors,
            "completed_by_process": [int(len(p["latencies"])) for p in parts],
            "cores_busy": busy,
            "queries_per_s": len(ms) / seconds,
            "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None}


def _process(kind, target, http_target, clients, texts, t0, seconds, priority, connections) -> dict:
    import uvloop

    return uvloop.run(_clients(kind, target, http_target, clients, texts, t0, seconds, priority, connections))


async def _clients(kind, target, http_target, clients, texts, t0, seconds, priority, connections) -> dict:
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    end = t0 + seconds
    latencies: list[float] = []
    errors = [0]
    channels = [grpc.aio.insecure_channel(target, options=[("pollen.load.connection", i)])
                for i in range(min(clients, connections))]
    stubs = [pb_grpc.EmbedderStub(c) for c in channels]
    prio = pb.PRIORITY_BULK if priority == "bulk" else pb.PRIORITY_INTERACTIVE

    def record(began: float) -> None:
        now = time.time()
        if t0 <= began and now <= end:
            latencies.append(now - began)

    async def unary(i: int) -> None:
        stub = stubs[i % len(stubs)]
        n = i
        while time.time() < end:
            request = pb.EmbedRequest(texts=[texts[n % len(texts)]], normalize=True, priority=prio)
            n += clients
            began = time.time()
            try:
                await stub.Embed(request, timeout=60)
                record(began)
            except grpc.RpcError:
                errors[0] += 1

    async def stream(i: int) -> None:
        call = stubs[i % len(stubs)].EmbedStream(timeout=3600)
        n = i
        while time.time() < end:
            began = time.time()
            await call.write(pb.EmbedRequest(id=str(n), texts=[texts[n % len(texts)]], normalize=True,
                                             priority=prio))
            answer = await call.read()
            if answer.HasField("error"):
                errors[0] += 1
            else:
                record(began)
            n += clients
        await call.done_writing()

    async def http(i: int) -> None:
        import h11

        host, _, port = http_target.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h11.Connection(our_role=h11.CLIENT)
        n = i
        while time.time() < end:
            body = json.dumps({"input": texts[n % len(texts)], "priority": priority}).encode()
            n += clients
            began = time.time()
            writer.write(conn.send(h11.Request(method="POST", target="/v1/embeddings", headers=[
                ("Host", host), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))])))
            writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status = await _read_response(conn, reader)
            conn.start_next_cycle()
            if status == 200:
                record(began)
            else:
                errors[0] += 1
        writer.close()

    while time.time() < t0 - 1.0:
        await asyncio.sleep(0.05)

    async def cpu_window() -> float:  # this process's CPU seconds over the timed window
        await asyncio.sleep(max(0.0, t0 - time.time()))
        began = time.process_time()
        await asyncio.sleep(max(0.0, end - time.time()))
        return time.process_time() - began

    window = asyncio.ensure_future(cpu_window())
    await asyncio.gather(*({"unary": unary, "stream": stream, "http": http}[kind](i) for i in range(clients)))
    for c in channels:
        await c.close()
    return {"latencies": np.array(latencies), "errors": errors[0], "cpu_s": await window}


def cores_busy(watch: dict[str, list[int]], t0: float, seconds: float) -> dict[str, float]:
    """Cores busy per group of pids over [t0, t0 + seconds] (user + system time, from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pids: list[int]) -> float:
        total = 0
        for pid in pids:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return total / tick

    time.sleep(max(0.0, t0 - time.time()))
    before = {pid: cpu([pid]) for pids in watch.values() for pid in pids}
    machine_before = _machine_cpu()
    time.sleep(max(0.0, t0 + seconds - time.time()))
    each = {pid: (cpu([pid]) - was) / seconds for pid, was in before.items()}
    machine = {k: round((v - machine_before[k]) / tick / seconds, 2) for k, v in _machine_cpu().items()}
    busy = {name: sum(each[pid] for pid in pids) for name, pids in watch.items()}
    # Threads each process holds at the end of the window (gRPC's, the tokenizers', tokie's): what
    # grows with the host's cores.
    busy["threads"] = {name: sum(_threads(pid) for pid in pids) for name, pids in watch.items()}
    # Each process's own share too: an uneven spread (one frontend saturated, another idle) shows there.
    busy["each"] = {str(pid): round(share, 2) for pid, share in each.items()}
    # The whole machine, in cores: what no process shows. Idle cores under a saturating load mean
    # the processes waited on each other; stolen ones, that the hypervisor ran someone else.
    busy["machine"] = machine
    return busy


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _machine_cpu() -> dict[str, int]:
    """The machine's CPU time so far, in clock ticks, from /proc/stat's first line: busy (user,
    nice, system, irq, softirq), idle (idle, iowait) and steal."""
    fields = [int(f) for f in open("/proc/stat").readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait, "steal": steal}


async def _read_response(conn, reader) -> int:
    import h11

    status = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(1 << 16))
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        if isinstance(event, h11.EndOfMessage):
            return status
