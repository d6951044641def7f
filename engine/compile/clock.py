"""What torch.compile costs a run, as the run reports it: time, graphs, and recompilations in train.log.

``CompileClock`` adds up the wall time of everything Dynamo's compile callbacks bracket in this process:
tracing and compiling a new graph (Inductor and AOTAutograd included), a backward compiled at its first
call, and a CUDA graph being recorded (also the graphs of the eager model, ``record_capture``). The loop
charges that time to "compile" rather than to training or evaluation, keeps it out of the ETA, and logs
"compiled N graphs in X s". Graphs and seconds are counted per compiled function (``co_name``: features, detect,
predict, stacked_losses ...): Dynamo names the compilation each callback brackets (a new graph, its backward
compiled at its first call, its CUDA graphs recorded), and its frame is the function's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch._dynamo

# What compile seconds are charged to when the callback did not say which compilation it bracketed (a torch whose
# callbacks take no arguments).
UNNAMED = "other"


@dataclass(frozen=True)
class CompileTotals:
    seconds: float = 0.0
    graphs: int = 0
    by_function: dict = field(default_factory=dict)  # co_name -> graphs
    seconds_by_function: dict = field(default_factory=dict)  # co_name -> seconds

    def since(self, earlier: "CompileTotals") -> "CompileTotals":
        by = {k: v - earlier.by_function.get(k, 0) for k, v in self.by_function.items()}
        seconds = {k: v - earlier.seconds_by_function.get(k, 0.0) for k, v in self.seconds_by_function.items()}
        return CompileTotals(seconds=self.seconds - earlier.seconds, graphs=self.graphs - earlier.graphs,
                             by_function={k: v for k, v in by.items() if v},
                             seconds_by_function={k: v for k, v in seconds.items() if v > 0})


class CompileClock:
    """Process-wide totals of compilation (one clock per process; ``CompileClock.get()``)."""

    _instance: "CompileClock | None" = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._started: float | None = None
        self._started_id: str | None = None  # Dynamo's compile id ("frame/recompilation") of what is compiling
        self._graphs: Counter = Counter()
        self._seen: set[tuple] = set()
        self._seconds_by_name: Counter = Counter()  # co_name (or a recorded method's name) -> seconds
        self._unnamed: list[tuple[str | None, float]] = []  # (compile id, seconds) whose function is not known yet
        self._frame_names: dict[str, str] = {}  # Dynamo's frame id -> co_name

    @classmethod
    def get(cls) -> "CompileClock":
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
            self._started_id = getattr(args[0], "compile_id", None) if args else None

    def _end(self, *args) -> None:
        with self._lock:
            if self._started is not None:
                elapsed = time.perf_counter() - self._started
                self._seconds += elapsed
                self._unnamed.append((self._started_id, elapsed))
                self._started = None

    def record_capture(self, name: str, seconds: float) -> None:
        """A CUDA graph recorded outside Dynamo (engine/compile/cuda_graphs.py): its time and one graph of ``name``."""
        with self._lock:
            self._seconds += seconds
            self._seconds_by_name[name] += seconds
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
                    self._frame_names[_frame(key[0])] = metrics.co_name
            # Seconds are charged once, when their frame's name is first known (frame ids start again after a
            # torch._dynamo.reset(), so a name looked up later could be another function's).
            waiting = []
            for compile_id, spent in self._unnamed:
                name = UNNAMED if compile_id is None else self._frame_names.get(_frame(compile_id))
                if name is None:
                    waiting.append((compile_id, spent))
                else:
                    self._seconds_by_name[name] += spent
            self._unnamed = waiting
            by_name = Counter(self._seconds_by_name)
            for compile_id, spent in waiting:
                by_name[UNNAMED] += spent
            seconds = self._seconds
            if self._started is not None:  # a compilation in progress counts up to now
                running = time.perf_counter() - self._started
                seconds += running
                by_name[self._frame_names.get(_frame(self._started_id), UNNAMED)] += running
            return CompileTotals(seconds=seconds, graphs=sum(self._graphs.values()), by_function=dict(self._graphs),
                                 seconds_by_function=dict(by_name))


def _frame(compile_id) -> str | None:
    """The frame part of a Dynamo compile id: "3" of "3/1" (its second graph of frame 3), which names one function."""
    return None if compile_id is None else str(compile_id).strip("[]").split("/")[0]


# The names ``record_capture`` counts CUDA graphs of the eager model under (engine/compile/cuda_graphs.py): this prefix
# and the recorded method's name.
CAPTURE_PREFIX = "graphed_"


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
    """Per function, the graphs compiled or recorded and the seconds that took: "1 features 21.3 s, 1 predict
    96.0 s"; a function that only took time (a backward compiled at its first call, CUDA graphs recorded) shows
    its seconds alone. Time under 0.05 s is left out."""
    names = sorted(set(totals.by_function) | {k for k, v in totals.seconds_by_function.items() if v >= 0.05})
    parts = []
    for name in names:
        words = [str(totals.by_function[name]), name] if name in totals.by_function else [name]
        seconds = totals.seconds_by_function.get(name, 0.0)
        if seconds >= 0.05:
            words.append(f"{seconds:.1f} s")
        parts.append(" ".join(words))
    return ", ".join(parts)
