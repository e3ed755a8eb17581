"""`pollen serve`: check the platform, the model and the settings, then run the supervisor
(server/process/supervisor.py) until SIGTERM or SIGINT. Everything that can be refused is refused here,
before a process starts, with one clear message (exit 1)."""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import platform
import resource
import signal

from pollen.common import defaults
from pollen.common.model_spec import ModelSpec
from pollen.server import auth
from pollen.server.config import ServeConfig, open_files_limit
from pollen.server.process import cpu_engines, served_model
from pollen.server.process.supervisor import Supervisor
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.segment import SHM_DIR, cleanup_stale_segments
from pollen.shared_mem.server_state import ServerState

log = logging.getLogger("pollen")

# prometheus_client's multiprocess files (server/observe/metrics.py) in /dev/shm: a counter and a histogram
# file for each process that counts (the supervisor and each frontend), 64 KiB each at first and
# doubling as label sets grow. 1 MiB a process leaves room for that growth and for the files a
# restarted frontend leaves behind.
SHM_METRICS_PER_PROCESS = 1 << 20


def response_ring_for(max_texts: int, hidden: int, text_rows: int = 0) -> int:
    """The smallest response ring whose batch records hold max_texts + 1 rows of `hidden` floats
    (a contextual-chunk document's answers cannot be split), and `text_rows` rows (one text's token
    rows, which cannot be split either), at least 16 MiB, in whole MiB."""
    rows = max(max_texts + 1, text_rows)
    record = records.raw_at(0) + rows * (4 * hidden + records.ENTRY.itemsize)
    return max(16 << 20, -(-2 * (record + Ring.RECORD_HEADER) // (1 << 20)) << 20)


def widest(specs: list[ModelSpec]) -> int:
    """The most float32 values one answer row of any served model holds."""
    return max(max(spec.hidden_size, spec.output_dims) for spec in specs)


def check_limits(cfg: ServeConfig, specs: list[ModelSpec]) -> None:
    """Size what is automatic (the response rings) and refuse at start the settings that would
    fail requests later, for every served model: the token budgets fit the longest model's limit
    and the rings the widest model's rows."""
    spec = max(specs, key=lambda s: s.max_tokens)  # the longest text any model reads
    hidden = widest(specs)
    if not cfg.max_batch_tokens:
        cfg.max_batch_tokens = defaults.batch_tokens(cfg.device, cfg.worker_threads, spec.max_tokens)
    if not cfg.bulk_batch_tokens:
        cfg.bulk_batch_tokens = defaults.bulk_batch_tokens(cfg.device, cfg.worker_threads, cfg.max_batch_tokens,
                                                           cfg.graph_max_tokens)
    if cfg.max_queued_tokens < cfg.max_batch_tokens:
        raise ValueError(f"--max-queued-tokens {cfg.max_queued_tokens} is below --max-batch-tokens "
                         f"{cfg.max_batch_tokens}")
    if cfg.max_batch_tokens < spec.max_tokens:
        raise ValueError(f"--max-batch-tokens {cfg.max_batch_tokens} is below the model's limit of "
                         f"{spec.max_tokens} tokens: one long text could never be batched")
    if not cfg.response_ring_bytes:
        # BGE-M3's sparse and ColBERT vectors are a row a token, and are what it is served for: its
        # ring holds one text of its longest that way, and batches of as many token rows.
        m3_rows = max((s.max_tokens for s in specs if s.bge_m3), default=0)
        cfg.response_ring_bytes = response_ring_for(cfg.max_texts_per_request, hidden, m3_rows)
        floor = response_ring_for(cfg.max_texts_per_request, hidden)
        cfg.response_ring_floor = floor if floor < cfg.response_ring_bytes else 0
    # A batch's answer record must fit the response ring; the worker caps the rows of a batch for
    # it (records.max_batch_rows), and one sequence can cost a request's outputs and a row more
    # (the chunks of a document, or the last text of a request begun in an earlier batch).
    batch_rows = records.max_batch_rows(Ring.max_record_for(cfg.response_ring_bytes), hidden)
    if batch_rows < cfg.max_texts_per_request + 1:
        raise ValueError(f"--response-ring-bytes {cfg.response_ring_bytes} is too small for answers of up to "
                         f"{cfg.max_texts_per_request} x {hidden} float32 values (one batch record "
                         f"would hold only {batch_rows} rows; 0 sizes it)")
    # A request over half the request ring travels as several records, but one text cannot be cut.
    longest = records.REQUEST_HEADER + 4 + records.ROW_BYTES + 4 * spec.max_tokens
    if longest > Ring.max_record_for(cfg.request_ring_bytes):
        raise ValueError(f"--request-ring-bytes {cfg.request_ring_bytes} cannot hold one text of "
                         f"{spec.max_tokens} tokens")


def shm_need(cfg: ServeConfig) -> int:
    """Bytes this server maps in /dev/shm, counted as tmpfs counts them (whole pages):
    frontends x workers x (request ring + response ring) + server state + metrics files, where a
    ring is its header and its capacity rounded up to 4 KiB (Ring.create). Call it after
    check_limits, which sizes an automatic response ring."""
    rings = cfg.workers * worker_rings_need(cfg)
    state = _pages(ServerState.size_for(cfg.frontends, cfg.workers))
    return rings + state + (1 + cfg.frontends) * SHM_METRICS_PER_PROCESS


def worker_rings_need(cfg: ServeConfig) -> int:
    """One worker's rings in /dev/shm (a request and a response ring per frontend): what a
    restarted worker maps anew while the frontends still map its old ones."""
    def ring(capacity: int) -> int:
        return _pages(Ring.HEADER_BYTES + -(-capacity // 4096) * 4096)

    return cfg.frontends * (ring(cfg.request_ring_bytes) + ring(cfg.response_ring_bytes))


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def check_shm(cfg: ServeConfig, free: int | None = None) -> None:
    """Refuse to start when /dev/shm has less free space than shm_need (`free`: its free bytes,
    read from /dev/shm when None). tmpfs files are sparse, so an undersized /dev/shm (Docker gives
    a container 64 MiB) would let every segment be created and fail later: SIGBUS in the process
    that first writes a ring page past the limit, under load, or on a GPU a worker that cannot pin
    its response rings (pinning needs every page).

    When pollen chose the frontend count itself (--frontends 0), it starts with as many as fit
    with room for one worker restart (at least one), and says so: a GPU server in a default
    Docker /dev/shm then runs, on fewer frontends, rather than not at all. A count the user set is
    never lowered. Before that, an automatic response ring grown for BGE-M3's token rows falls back
    to the size it would have for any model (cfg.response_ring_floor), and says so."""
    if free is None:
        fs = os.statvfs(SHM_DIR)
        free = fs.f_bavail * fs.f_frsize
    need = shm_need(cfg)
    mib = 1 << 20
    if need > free and cfg.response_ring_floor:
        grown, cfg.response_ring_bytes, cfg.response_ring_floor = cfg.response_ring_bytes, cfg.response_ring_floor, 0
        log.warning("%s has %.1f MiB free, too little for %d frontend(s) with BGE-M3's automatic %.0f MiB response "
                    "rings (one text of its longest as token rows): using %.0f MiB rings, so its sparse and ColBERT "
                    "vectors serve shorter texts (a longer one is refused, naming the bound); give it more shared "
                    "memory (docker run --shm-size, or a memory emptyDir on /dev/shm in Kubernetes) to lift that",
                    SHM_DIR, free / mib, cfg.frontends, grown / mib, cfg.response_ring_bytes / mib)
        need = shm_need(cfg)
    if need > free and cfg.frontends_automatic and cfg.frontends > 1:
        wanted = cfg.frontends
        while cfg.frontends > 1 and shm_need(cfg) + worker_rings_need(cfg) > free:
            cfg.frontends -= 1
        if shm_need(cfg) <= free:
            log.warning("%s has %.1f MiB free, too little for the %d frontends this machine's cores call for "
                        "(%.1f MiB): starting %d; give it more shared memory (docker run --shm-size, or a memory "
                        "emptyDir on /dev/shm in Kubernetes) to get them all", SHM_DIR, free / mib, wanted,
                        need / mib, cfg.frontends)
            return
        cfg.frontends = wanted  # not even one fits: refuse, naming the count that was asked for
    if need > free:
        raise ValueError(
            f"{SHM_DIR} has {free / mib:.1f} MiB free but this server needs {need / mib:.1f} MiB there: "
            f"{cfg.frontends} frontend(s) x {cfg.workers} worker(s) x ({cfg.request_ring_bytes / mib:.1f} MiB "
            f"request ring + {cfg.response_ring_bytes / mib:.1f} MiB response ring), plus the server state and "
            f"{(1 + cfg.frontends) * SHM_METRICS_PER_PROCESS / mib:.0f} MiB of metrics files. Give it more shared "
            f"memory (docker run --shm-size, or a memory emptyDir on /dev/shm in Kubernetes) or lower "
            f"--request-ring-bytes, --response-ring-bytes or --frontends")


def check_platform() -> None:
    """The rings rely on x86-64 memory ordering (shared_mem/ring.py says why); refuse elsewhere
    rather than risk reading a record before its bytes land."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"pollen's shared-memory rings need x86-64 memory ordering; this machine is "
                           f"{platform.machine()!r}, where they would need fences Python cannot issue")


def raise_fd_limit() -> None:
    """Raise the soft open-files limit to the one --http-max-connections was checked against
    (the frontends inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_files_limit()
    if soft < limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


async def serve(cfg: ServeConfig, metrics_dir: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT."""
    check_platform()
    raise_fd_limit()
    removed = cleanup_stale_segments()
    if removed:
        log.info("removed %d shared-memory segments left by a dead server", len(removed))
    auth.hand_down(cfg)  # the API keys, read and checked once, go to the frontends' environment (server/auth.py)
    specs = served_model.prepare(cfg)  # a Hub id becomes its local snapshot here, once (server/process/served_model.py)
    check_limits(cfg, specs)
    check_shm(cfg)
    cpu_engines.prepare(cfg, specs)  # each CPU model's engine, and its ONNX export, made here once
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(cfg, metrics_dir)
    started = False
    try:
        names = ", ".join(spec.name for spec in specs)
        log.info("loading %s on %d %s worker(s), %d frontend(s)", names, cfg.workers, cfg.device, cfg.frontends)
        starting = asyncio.ensure_future(supervisor.start())
        await asyncio.wait({starting, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # raises if the server could not start
            log.info("serving %s on %s (gRPC)%s", names, supervisor.listen,
                     f" and {supervisor.http_listen} (HTTP)" if supervisor.http_listen else "")
            await stop.wait()
        else:
            starting.cancel()
        log.info("stopping: finishing the work in flight (up to %.0f s)", cfg.shutdown_grace)
        started = True
    finally:
        await supervisor.stop()
        if started:  # a failed start ends with its error (logged by the caller), not with "stopped"
            log.info("stopped")
