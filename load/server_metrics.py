"""A running server's /metrics samples, read once its frontends have written out their counts."""
from __future__ import annotations

import time
import urllib.request


def settled_samples(http_target: str) -> list:
    """Every sample of the server's /metrics (prometheus_client Samples). The frontends write
    their per-request counts at most FLUSH_S after they happen (server/observe/metrics.py); scraped at
    once, the last of one load's counts would land in the next one's figures (a one-client level
    after the cold start once showed 51 tokens a batch that way), so this waits that long first."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        from pollen.server.observe.metrics import FLUSH_S
    except ImportError:  # a pollen before server/ was split by role (load/ab_commits.sh measures one)
        from pollen.server.metrics import FLUSH_S

    time.sleep(FLUSH_S + 0.25)
    with urllib.request.urlopen(f"http://{http_target}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
