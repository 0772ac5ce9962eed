"""A dependency-free progress bar (one line, redrawn with ``\\r`` on a terminal)."""

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress('pretrain', total=300) as bar: ... bar.update(loss=2.1)``.

    On a terminal the line is redrawn in place; otherwise (logs, CI, a test's pipe) it prints
    a line at every 25% and at the end, so captured output stays short.
    """

    WIDTH = 24

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None):
        self.label = label
        self.total = max(int(total), 0)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, 'isatty', lambda: False)())
        self.done = 0
        self.info = ''
        self.start = time.monotonic()
        self._last_quarter = -1
        self._printed = -1
        self._last_draw = 0.0

    def __enter__(self) -> 'Progress':
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self._draw(force=True, final=True)

    def update(self, n: int = 1, **info) -> None:
        """Advance by ``n`` and show ``info`` (e.g. ``loss=2.13``) after the bar."""
        self.done = min(self.done + n, self.total)
        if info:
            self.info = ' '.join(
                f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in info.items()
            )
        self._draw()

    def _line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.WIDTH))
        bar = '#' * filled + '.' * (self.WIDTH - filled)
        elapsed = time.monotonic() - self.start
        return (f'{self.label:<16} [{bar}] {self.done:>5}/{self.total:<5} {elapsed:6.1f}s'
                f'{"  " + self.info if self.info else ""}')

    def _draw(self, force: bool = False, final: bool = False) -> None:
        if self.tty:
            now = time.monotonic()
            if force or now - self._last_draw > 0.1:
                self.stream.write('\r' + self._line() + '\033[K' + ('\n' if final else ''))
                self.stream.flush()
                self._last_draw = now
            return
        quarter = int(4 * self.done / self.total) if self.total else 4
        if quarter > self._last_quarter or (final and self.done != self._printed):
            self.stream.write(self._line() + '\n')
            self.stream.flush()
            self._last_quarter, self._printed = quarter, self.done
