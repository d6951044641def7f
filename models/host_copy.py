"""Host values to the GPU without a sync: the one way the model, the criterion and the step copy them.

``torch.tensor(values, device="cuda")`` (or ``.to("cuda")`` from ordinary memory) waits until the GPU has
finished everything queued before it; the training step would stall on its own queue. A copy from
page-locked memory is asynchronous, and the caching host allocator keeps the buffer alive until the copy
has run. Under torch.compile the tensor is part of the graph (its values may be symbolic sizes), so it is
left to the compiler.
"""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, copied without waiting for the GPU."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
