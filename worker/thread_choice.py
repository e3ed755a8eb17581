"""How many threads the CPU engines' batches run on, chosen by what the batches measure.

A CPU sidecar shares its cores with the service it serves. On idle cores, an intra-op pool (torch's,
or ONNX Runtime's) of one thread per core is fastest, for docs and for a query's forward alike, though for a query
on few cores it buys little for its CPU (SMALL_MIN_SPEEDUP). When other processes keep the cores
busy, each parallel region waits at its barrier for the thread that lost its core, and a layer
has dozens of regions: the same batches then run several times slower on two threads than on
one. No setting is right for both, and which one holds changes with the neighbours' load.

So the engine measures, in two classes of batch that it learns apart: small ones (under
LEARN_TOKENS tokens: queries, whose time is mostly fixed costs, so a batch's seconds are its
figure) and large ones (seconds per token: one long text; a batch of many texts runs in pieces
instead, one thread each, worker/engine.py). In each class, every batch records its figure
under the thread count it ran on (an exponential average for the count in use); batches run on the
count with the lower figure (a small batch on more threads only where that figure is
SMALL_MIN_SPEEDUP times lower; two batches in a row over STEP times their count's figure replace
it: a change of load shows at once, a lone hiccup does not), and every PROBE_EVERY-th batch of the class
runs on the other one, whose figure that probe replaces, so a count's figure never goes stale by
more than that many batches of its class. A step seen in one class scales the other class's
figure for that count by the same factor (and brings that class's next probe closer, to check
it), so docs arriving after queries saw the cores taken start on the right count.
"""
from __future__ import annotations

LEARN_TOKENS = 256
PROBE_EVERY = 24
SMOOTHING = 0.3  # the weight of the newest batch in the count in use's average
STEP = 2.0  # STEP_BATCHES batches in a row this many times their count's figure: the load changed
STEP_BATCHES = 2
# A small batch (a query) takes the pool only where it runs at least this much faster than on one
# thread. A query's forward is mostly products of a few rows, bound by reading the weights, and
# the serial ops between them, through which the pool's helper threads spin: on two cores two
# threads save a query far less time than the CPU they add, which a sidecar's neighbours pay.
# Many cores buy a query several times its speed, and keep the pool.
SMALL_MIN_SPEEDUP = 1.5


class CountChoice:
    """One class of batch's choice between the counts in `counts` (the first is the default)."""

    def __init__(self, counts: tuple[int, ...], min_speedup: float = 1.0):
        self.counts = counts
        self.min_speedup = min_speedup  # what more threads must buy over the fewest to be chosen
        self.cost: dict[int, float | None] = dict.fromkeys(counts)
        self.current = counts[0]
        self.since_probe = 0
        self.slow, self.slow_factor = 0, 0.0  # batches in a row over STEP, and the least factor among them

    def next_count(self) -> int:
        if len(self.counts) == 1:
            return self.current
        untried = [c for c in self.counts if self.cost[c] is None]
        if untried:
            return untried[0]
        if self.since_probe >= PROBE_EVERY:
            self.since_probe = 0
            return next(c for c in self.counts if c != self.current)
        return self.current

    def ran(self, count: int, figure: float) -> float | None:
        """Record a batch's figure; where it confirms a step (the STEP_BATCHES-th batch in a row
        over STEP times its count's figure), the factor it is slower by, else None."""
        old = self.cost[count]
        over = old is not None and count == self.current and figure > STEP * old
        self.slow = self.slow + 1 if over else 0
        self.slow_factor = min(self.slow_factor, figure / old) if self.slow > 1 else (figure / old if over else 0.0)
        step = self.slow >= STEP_BATCHES
        if old is None or count != self.current or step:
            # A probe's figure replaces its count's figure, which is PROBE_EVERY batches stale:
            # the neighbours' load may have changed since; so does a confirmed step (cores just
            # taken by others slow every batch on two threads several times over, and averaging
            # that in would cost several such batches before the switch).
            self.cost[count] = figure
        elif not over:  # one batch over STEP is left out until the next confirms it: a hiccup
            self.cost[count] = old + SMOOTHING * (figure - old)
        self.since_probe += 1
        self._choose()
        if not step:
            return None
        self.slow = 0
        return self.slow_factor

    def scale(self, count: int, factor: float) -> None:
        """What another class just measured: `count` is `factor` times slower than it was. The
        next probe comes sooner, to check it for this class."""
        if self.cost.get(count) is not None:
            self.cost[count] *= factor
            self.since_probe = max(self.since_probe, PROBE_EVERY - PROBE_EVERY // 4)
            self._choose()

    def _choose(self) -> None:
        known = {c: v for c, v in self.cost.items() if v is not None}
        best, fewest = min(known, key=known.get), min(known)
        self.current = best if known[fewest] >= self.min_speedup * known[best] else fewest


class ThreadChoice:
    """Between one thread and `most` (the --worker-threads count); with `adapt` off, always `most`."""

    def __init__(self, most: int, adapt: bool = True):
        counts = (most, 1) if adapt and most > 1 else (most,)
        self.small, self.large = CountChoice(counts, SMALL_MIN_SPEEDUP), CountChoice(counts)

    def _class(self, tokens: int) -> CountChoice:
        return self.large if tokens >= LEARN_TOKENS else self.small

    def threads_for(self, tokens: int) -> int:
        """The count the next batch of `tokens` runs on (the engine sets its pool to it)."""
        return self._class(tokens).next_count()

    def ran(self, count: int, tokens: int, seconds: float) -> None:
        """A batch of `tokens` took `seconds` on `count` threads. A step in one class's figure
        scales the other's for that count: the load that slowed queries slows docs alike, and
        finding out from a docs batch of its own costs that batch several times over."""
        large = tokens >= LEARN_TOKENS
        this, other = (self.large, self.small) if large else (self.small, self.large)
        step = this.ran(count, seconds / tokens if large else seconds)
        if step is not None:
            other.scale(count, step)
