"""Methods that engine.compile may replace by compiled versions, per instance, and what copying does to them.

``compile=true`` puts ``torch.compile(model.predict)`` (or, with ``compile_regions=layers``,
``torch.compile(model.heads)``; ``compile_backbone=static`` and the benches' ``--compile-backbone dynamic`` add
``torch.compile(model.features)``)
into the instance's attributes (parameters and state_dict keys stay where they are). A copy must not inherit
it: the compiled function holds the original's bound method, so a deep copy would run the original's weights,
and a pickle would fail. Copies and pickles drop it and fall back to the plain method, as
``nn.Module.compile``'s own compiled call is dropped.
"""

from __future__ import annotations


class CompiledMethods:
    """Mixin for an nn.Module: ``compiled_methods`` names the methods that may be shadowed by compiled ones."""

    compiled_methods: tuple[str, ...] = ()

    def __getstate__(self):
        state = super().__getstate__()
        for name in self.compiled_methods:
            state.pop(name, None)
        return state
