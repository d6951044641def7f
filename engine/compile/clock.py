"""What compilation costs a run: seconds, and graphs per compiled function (``co_name``: features, predict ...).

``CompileClock`` adds up the time Dynamo's compile callbacks bracket in this process and that of the eager model's
CUDA graph recordings (``record_capture``); the run reports it as "compile", apart from training and the ETA.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch._dynamo

# record_capture's names: this prefix and the recorded method's name.
CAPTURE_PREFIX = "graphed_"


@dataclass(frozen=True)
class CompileTotals:
    seconds: float = 0.0
    graphs: int = 0
    by_function: dict = field(default_factory=dict)  # co_name (or a recorded method's) -> graphs

    def since(self, earlier: CompileTotals) -> CompileTotals:
        by = {k: v - earlier.by_function.get(k, 0) for k, v in self.by_function.items()}
        return CompileTotals(seconds=self.seconds - earlier.seconds, graphs=self.graphs - earlier.graphs,
                             by_function={k: v for k, v in by.items() if v})


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
        cls._instance._register()
        return cls._instance

    def _register(self) -> None:
        callbacks = getattr(torch._dynamo, "callback", None)
        handler = getattr(callbacks, "callback_handler", None)
        if handler is None:
            return
        if self._start not in handler.start_callbacks:
            handler.register_start_callback(self._start)
        if self._end not in handler.end_callbacks:
            handler.register_end_callback(self._end)

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
        from torch._dynamo.utils import get_compilation_metrics

        with self._lock:
            for metrics in get_compilation_metrics():
                # Frame ids start again after torch._dynamo.reset(): the start time tells two "0/0"s apart.
                key = (str(getattr(metrics, "compile_id", None)), getattr(metrics, "start_time_us", None)
                       or getattr(metrics, "start_time", None))
                if key not in self._seen and getattr(metrics, "co_name", None):
                    self._seen.add(key)
                    self._graphs[metrics.co_name] += 1
            seconds = self._seconds
            if self._started is not None:
                seconds += time.perf_counter() - self._started
            return CompileTotals(seconds=seconds, graphs=sum(self._graphs.values()), by_function=dict(self._graphs))


def describe_work(totals: CompileTotals) -> str:
    """What a step's compile totals did: "compiled N graphs", "recorded N CUDA graphs" (a recording of a method at
    one size, its forward and backward counted as one), or both."""
    recorded = sum(n for name, n in totals.by_function.items() if name.startswith(CAPTURE_PREFIX))
    compiled = totals.graphs - recorded
    parts = [f"compiled {compiled} graphs"] if compiled else []
    if recorded:
        parts.append(f"recorded {recorded} CUDA {'graph' if recorded == 1 else 'graphs'}")
    return " and ".join(parts) or "recorded CUDA graphs"


def describe_graphs(totals: CompileTotals) -> str:
    """Per function, the graphs compiled or recorded: "1 features, 1 predict"."""
    return ", ".join(f"{n} {name}" for name, n in sorted(totals.by_function.items()))
