"""Benchmark the MTP TV losses against Megatron's cross-entropy, CPU fp32, side by side.

    .venv/bin/python tools/bench_loss.py                      # loss, mtp, tp rows (~45 min)
    .venv/bin/python tools/bench_loss.py --cases step,wide     # the GPTModel step, large h
    .venv/bin/python tools/bench_loss.py --quick --json x.json  # tiny shapes, seconds

The benchmark is the package ``tools/lossbench`` (its row groups and targets are described
there); this is its command (``make bench``).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_HERE, _ROOT):  # tools/ for lossbench, the repository for megatron.mtp_tv
    if _p not in sys.path:
        sys.path.insert(0, _p)

from lossbench.cli import main  # noqa: E402

if __name__ == '__main__':
    main()
