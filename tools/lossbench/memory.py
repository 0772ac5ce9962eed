"""CPU memory accounting for the loss benchmark (``tools/bench_loss.py``, :mod:`lossbench`).

torch keeps no allocator statistics for CPU tensors, so two small instruments stand in:

* :class:`LiveBytesTracker` - a ``TorchDispatchMode`` that sees every tensor an ATen op returns
  while it is active, records the bytes of each *new* untyped storage (keyed by the storage
  object, whose Python object torch keeps alive exactly as long as the C++ storage), and
  subtracts them when ``weakref.finalize`` reports the storage freed. ``peak`` is the maximum of
  the live bytes allocated since the mode was entered, i.e. "peak extra bytes above what existed
  before" (tensors that existed before are never counted, whatever happens to them).
  Blind spots, all irrelevant for the shapes benchmarked here: kernel-internal workspaces (MKL,
  oneDNN), allocator rounding and fragmentation, memory held by the process group.
* :class:`SavedTensorsCounter` - ``torch.autograd.graph.saved_tensors_hooks`` that record every
  tensor autograd saves for backward. Only storages *created during the forward* (as seen by the
  tracker) are counted, each storage once: parameters and input leaves saved by reference (and
  views of them) cost nothing extra and are excluded.

Both are plain Python, used around one untimed forward+backward (the dispatch mode costs a
Python call per op, so timing runs never use it).
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = float(1 << 20)


class LiveBytesTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created while the mode is active.

    Use as a context manager around the code to measure; read :attr:`peak` (bytes) afterwards.
    :meth:`mark` starts a new phase whose own peak is reported by :meth:`phase_peak`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # id(storage python object) -> [nbytes]; the object stays alive while the storage does.
        self._sizes: Dict[int, List[int]] = {}
        self._phase_peaks: Dict[str, int] = {}
        self._phase: Optional[str] = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _bump(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live
        if self._phase is not None and self.live > self._phase_peaks[self._phase]:
            self._phase_peaks[self._phase] = self.live

    def _freed(self, key: int) -> None:
        entry = self._sizes.pop(key, None)
        if entry is not None:
            self.live -= entry[0]

    def track(self, tensor: torch.Tensor) -> None:
        """Account for ``tensor``'s storage if it is new (also used for op outputs)."""
        if tensor.device.type == 'meta' or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = id(storage)
        entry = self._sizes.get(key)
        if entry is None:
            if nbytes == 0:
                return
            self._sizes[key] = [nbytes]
            weakref.finalize(storage, self._freed, key)
            self._bump(nbytes)
        elif entry[0] != nbytes:  # resized in place (out= ops)
            delta = nbytes - entry[0]
            entry[0] = nbytes
            self._bump(delta)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage was created while this tracker was active (and is alive)."""
        return id(tensor.untyped_storage()) in self._sizes

    def mark(self, phase: str) -> None:
        """Start phase ``phase`` (its peak starts at the current live bytes)."""
        self._phase = phase
        self._phase_peaks[phase] = self.live

    def phase_peak(self, phase: str) -> int:
        return self._phase_peaks.get(phase, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place or out= op) is no new
        # allocation: if that input was allocated under this tracker it is counted already, and
        # if it existed before (a parameter, an input leaf) it must never be counted.
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != 'meta' and not t.is_sparse
        }
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                key = id(leaf.untyped_storage())
                if key not in inputs or key in self._sizes:
                    self.track(leaf)
        return out


class SavedTensorsCounter:
    """Bytes autograd saves for backward, counting only storages the tracker saw created."""

    def __init__(self, tracker: LiveBytesTracker) -> None:
        self.tracker = tracker
        self.bytes = 0
        self.tensors: List[tuple] = []  # (shape, dtype, storage bytes) of each counted storage
        self._seen = set()
        self._refs: List[torch.Tensor] = []  # keep counted storages alive: ids stay unique
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._seen and self.tracker.owns(tensor):
            self._seen.add(key)
            self._refs.append(tensor)
            self.bytes += storage.nbytes()
            self.tensors.append((tuple(tensor.shape), str(tensor.dtype), storage.nbytes()))
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def release(self) -> None:
        """Drop the references kept for de-duplication (call after the forward)."""
        self._refs.clear()

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.release()
        return False


def linear_fit(xs: List[float], ys: List[float]):
    """Least-squares ``y = intercept + slope * x``; ``(None, None)`` with fewer than two x."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None, None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope
