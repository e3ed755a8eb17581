"""Hold the host's CPU wake-up latency limit (Linux PM QoS, /dev/cpu_dma_latency) for an A/B.

    python load/hold_cpu_latency.py [--us 0]      # holds until killed (needs root)
    python load/hold_cpu_latency.py --show        # prints the cpuidle driver, governor and states

While a process keeps /dev/cpu_dma_latency open with a value written to it, the kernel keeps every
CPU out of idle states whose exit latency exceeds that many µs (0: the shallowest, or polling).
A lone query crosses several sleeping threads (the client's, gRPC's poller, the event loop), and
each wake-up pays its core's exit latency; this measures what that costs, host-wide, without
touching pollen. pollen never sets it itself: it is a host policy (tuned's latency-performance
profile sets the same), and it costs power.
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import struct
import sys


def show() -> str:
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "-"

    base = "/sys/devices/system/cpu/cpuidle"
    lines = [f"cpuidle driver: {read(base + '/current_driver')}",
             f"cpuidle governor: {read(base + '/current_governor_ro')} / {read(base + '/current_governor')}"]
    for state in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        lines.append(f"cpu0 {os.path.basename(state)}: {read(state + '/name')}, exit latency "
                     f"{read(state + '/latency')} µs, disabled {read(state + '/disable')}")
    lines.append(f"/dev/cpu_dma_latency: {'present' if os.path.exists('/dev/cpu_dma_latency') else 'absent'}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--us", type=int, default=0, help="the wake-up latency limit to hold, µs")
    p.add_argument("--show", action="store_true")
    args = p.parse_args()
    if args.show:
        print(show())
        return
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", args.us))  # the limit holds while fd stays open
    print(f"holding /dev/cpu_dma_latency at {args.us} µs", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
