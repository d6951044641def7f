"""What compilation costs a run, reported as "compile" apart from training and the ETA: the seconds and graphs per
function (``co_name``) of Dynamo's compiles in this process and of the eager model's CUDA graph recordings."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch._dynamo.utils import get_compilation_metrics

CAPTURE_PREFIX = "graphed_"  # record_capture's names: this prefix and the recorded method's name


@dataclass(frozen=True)
class CompileTotals:
    seconds: float = 0.0
    graphs: int = 0
    by_function: dict = field(default_factory=dict)  # co_name (or a recorded method's) -> graphs

    def since(self, earlier: CompileTotals) -> CompileTotals:
        by = {k: v - earlier.by_function.get(k, 0) for k, v in self.by_function.items()}
        return CompileTotals(
            seconds=self.seconds - earlier.seconds,
            graphs=self.graphs - earlier.graphs,
            by_function={k: v for k, v in by.items() if v},
        )


class CompileClock:
    """Process-wide totals of compilation (one clock per process; ``CompileClock.get()``)."""

    _instance: CompileClock | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._started: float | None = None
        self._graphs: Counter = Counter()
        self._seen: set[tuple] = set()

    @classmethod
    def get(cls) -> CompileClock:
        """The process's clock, its callbacks (re)registered: torch._dynamo.reset() clears them."""
        if cls._instance is None:
            cls._instance = cls()
        clock = cls._instance
        handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
        if handler is not None:
            if clock._start not in handler.start_callbacks:
                handler.register_start_callback(clock._start)
            if clock._end not in handler.end_callbacks:
                handler.register_end_callback(clock._end)
        return clock

    def _start(self, *args) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _end(self, *args) -> None:
        with self._lock:
            if self._started is not None:
                self._seconds += time.perf_counter() - self._started
                self._started = None

    def record_capture(self, name: str, seconds: float) -> None:
        """A CUDA graph recorded outside Dynamo (engine/compile/cuda_graphs.py): its time and one graph of ``name``."""
        with self._lock:
            self._seconds += seconds
            self._graphs[name] += 1

    def totals(self) -> CompileTotals:
        """Seconds and graphs so far (a compile in progress counts up to now)."""
        with self._lock:
            for metrics in get_compilation_metrics():
                # Frame ids start again after torch._dynamo.reset(): the start time tells two "0/0"s apart.
                key = (
                    str(getattr(metrics, "compile_id", None)),
                    getattr(metrics, "start_time_us", None) or getattr(metrics, "start_time", None),
                )
                if key not in self._seen and getattr(metrics, "co_name", None):
                    self._seen.add(key)
                    self._graphs[metrics.co_name] += 1
            seconds = self._seconds
            if self._started is not None:
                seconds += time.perf_counter() - self._started
            return CompileTotals(seconds=seconds, graphs=sum(self._graphs.values()), by_function=dict(self._graphs))


def describe_work(totals: CompileTotals) -> str:
    """A step's compile work: "compiled N graphs", "recorded N CUDA graphs" (one per method and size), or both."""
    recorded = sum(n for name, n in totals.by_function.items() if name.startswith(CAPTURE_PREFIX))
    compiled = totals.graphs - recorded
    parts = [f"compiled {compiled} graphs"] if compiled else []
    if recorded:
        parts.append(f"recorded {recorded} CUDA {'graph' if recorded == 1 else 'graphs'}")
    return " and ".join(parts) or "recorded CUDA graphs"


def describe_graphs(totals: CompileTotals) -> str:
    """Per function, the graphs compiled or recorded: "1 features, 1 predict"."""
    return ", ".join(f"{n} {name}" for name, n in sorted(totals.by_function.items()))
