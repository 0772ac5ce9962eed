"""Named buffers the loss sweep reuses from one chunk to the next."""

from typing import Dict

import torch


class Scratch:
    def __init__(self):
        self._buffers: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)
