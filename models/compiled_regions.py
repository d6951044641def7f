"""The parts of a model that may be compiled, as the model declares them, and how compiling one is applied.

A model lists its regions (``compile_regions(...)`` -> [Region]); engine/compile/plan.py decides the options
(backend, CUDA graphs) and compiles each: a method region is replaced per instance by its compiled version
(``use_compiled``; parameters and state_dict keys stay where they are), a submodule region is compiled in
place (``nn.Module.compile``). A copy or a pickle must not inherit a compiled method: the compiled function
holds the original's bound method, so a deep copy would run the original's weights and a pickle would fail.
Copies and pickles drop them and fall back to the plain methods, as ``nn.Module.compile``'s own compiled
call is dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """One part of a model that engine/compile/plan.py may compile.

    name          a method of the model, or the dotted path of a submodule
    method        True: a method, replaced per instance; False: a submodule, compiled in place
    static_sizes  one graph per input size (compiled with its sizes fixed) instead of one with symbolic sizes
    whole         one graph with no break (fullgraph): a break would bring back the host cost it removes
    starts_step   a call is a new step of the CUDA-graph trees: the outputs of the last call are done with
    training      recorded as CUDA graphs of the eager model (engine/compile/cuda_graphs.py, ``compile_regions(graphs=
                  True)``): True, its forward and backward (a training call); False, a forward without gradients
    """

    name: str
    method: bool = True
    static_sizes: bool = False
    whole: bool = False
    starts_step: bool = False
    training: bool = False


class CompiledRegions:
    """Mixin for an nn.Module that declares its compiled regions (``compile_regions``, overridden)."""

    def compile_regions(self, **choices) -> list[Region]:
        return []

    def use_compiled(self, name: str, compiled: Callable) -> None:
        """Call ``compiled`` instead of the method ``name`` on this instance (a method region)."""
        if not inspect.isfunction(getattr(type(self), name, None)):
            raise ValueError(f"{type(self).__name__}.{name} is not a method that can be compiled")
        self.__dict__[name] = compiled

    def __getstate__(self):
        state = super().__getstate__()
        return {k: v for k, v in state.items() if not inspect.isfunction(getattr(type(self), k, None))}
