"""gRPC core's settings for the frontend processes: set in their environment (gRPC reads it once,
when it starts), unless the user's environment sets the same variable (an empty value gives gRPC's
own defaults back).

GRPC_EXPERIMENTS turns off the experiments that read and write sockets, and accept connections, on
EventEngine threads, which then wake the thread that waits on the completion queue (a grpc.aio
server's poller thread, which wakes the event loop). On gRPC's older iomgr path that thread polls
the sockets itself: one cross-thread wake-up less each way per call, which a lone query feels in
its latency and a loaded frontend pays for in CPU. A grpcio that no longer knows one of these
experiments logs "Unknown experiment" and keeps its defaults; tests/test_frontend_grpc_core.py
then fails.
"""
from __future__ import annotations

# Every experiment that moves a socket off the completion queue's own poller.
IOMGR_EXPERIMENTS = ("-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints,"
                     "-event_engine_callback_cq")
GRPC_CORE_ENV = {"GRPC_EXPERIMENTS": IOMGR_EXPERIMENTS}
