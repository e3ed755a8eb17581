"""gRPC core's settings for the frontend processes: set in their environment (gRPC reads it once,
when it starts), unless the user's environment sets the same variable (an empty value gives gRPC's
own defaults back).

GRPC_EXPERIMENTS: in the grpcio releases pollen takes (1.84 on), gRPC reads and writes its sockets,
and accepts connections, on EventEngine threads, which then wake the thread that waits on the
completion queue (a grpc.aio server's poller thread, which in turn wakes the event loop). With
these experiments off, gRPC takes its older iomgr path: the thread that waits on the completion
queue polls the sockets itself, so a call's bytes reach the handler with one cross-thread wake-up
less each way. A lone query feels each wake-up, and a frontend under load pays for each in CPU. On
the 2-core machine, grpc.aio answering a fixed vector to grpc's blocking stub (`python
load/bench_grpc_latency.py`): p50 0.31 against 0.37 ms a call with only the server's side changed
(0.22 with both ends); under 32 clients (`load/bench_frontend_floor.py`) 108 against 126 µs of the
server's CPU a call, and a real frontend 190 against 207. On the H200
(load/results/gpu-grpc-latency-2026-12-02.md) 0.38 against 0.47 ms (0.16 with both ends), and one
client of a full server about 0.1 ms faster (docs/architecture.md, "gRPC core's own threads"). A
grpcio that no longer knows one of these experiments logs "Unknown experiment" and carries on with
its defaults; tests/test_frontend_grpc_core.py then fails.
"""
from __future__ import annotations

# Every experiment that moves a socket off the completion queue's own poller.
IOMGR_EXPERIMENTS = ("-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints,"
                     "-event_engine_callback_cq")
GRPC_CORE_ENV = {"GRPC_EXPERIMENTS": IOMGR_EXPERIMENTS}
