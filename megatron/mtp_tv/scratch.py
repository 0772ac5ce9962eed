"""The buffer pool of the loss sweep: named buffers reused from one chunk to the next.

A module of its own because two modules use it and neither should own it: :mod:`.linear_tv`
keeps each chunk's inputs and ``[m, V/tp]`` logits in one (the sweep's largest allocations,
taken twice per chunk), and :class:`.row_ops.TorchRowOps` its per-block temporaries; ``row_ops``
sits below ``linear_tv`` in the import order, so the class cannot live in ``linear_tv``.
"""

from typing import Dict

import torch


class Scratch:
    """Named buffers reused from one chunk to the next; each only ever grows."""

    def __init__(self):
        self._buffers: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` view of buffer ``name``."""
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)
