"""Warnings about what clients send, at most one per interval, so that no client can fill the log."""
from __future__ import annotations

import logging
import time


class ThrottledLog:
    """A warning at most once per `interval` seconds, saying how many events it stands for."""

    def __init__(self, logger: logging.Logger, interval: float):
        self.logger, self.interval = logger, interval
        self.count, self.last = 0, -interval

    def warning(self, message: str, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.logger.warning(message + " (%d since the last of these warnings)", *args, self.count)
            self.count, self.last = 0, now
