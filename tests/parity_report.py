"""Print the max abs differences behind the parallel-layout tests (for notes and the README).

    .venv/bin/python -m tests.parity_report

Whole model: TP=2 (with/without sequence parallel) against TP=1, over every gathered parameter
gradient and the logged per-depth losses. process_mtp_loss level: context-parallel ranks and
packed rows against the full-sequence reference of mtp_tv_dev/reference.py, in Megatron's zigzag
layout and in NVIDIA dev's contiguous one.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtp_tv_dev.distributed import spawn  # noqa: E402
from tests import test_parallel as tp  # noqa: E402


def _model_rows():
    for loss_type, depth in (('tv', 2), ('e2e_tv', 3)):
        for tie in (True, False):
            ((ref, ref_logged, _), _), = spawn(tp._model_worker, 1, loss_type, depth, tie, False)
            for sp in (False, True):
                worst_grad = worst_loss = 0.0
                for runs in spawn(tp._model_worker, 2, loss_type, depth, tie, sp, tp=2):
                    for params, logged, _ in runs:  # both target sources
                        for name, full in params.items():
                            if full.grad is not None:
                                worst_grad = max(worst_grad,
                                                 (full.grad - ref[name].grad).abs().max().item())
                        worst_loss = max(worst_loss, (logged - ref_logged).abs().max().item())
                layout = f"TP=2{' +SP' if sp else ''} vs TP=1, {'tied' if tie else 'untied'}"
                yield loss_type, layout, worst_loss, worst_grad


def _loss_rows():
    cases = [('CP=2 zigzag vs full sequence', 16, None, 1, 2), ('packed, 3 sequences', 16, [5, 8, 3], 1, 1),
             ('packed + CP=2', 36, [8, 12, 16], 4, 2)]
    for loss_type, depth in (('tv', 2), ('e2e_tv', 2)):
        for layout, s, lengths, pad, cp in cases:
            bounds = None
            if lengths:
                bounds = [0]
                for n in lengths:
                    bounds.append(bounds[-1] + n)
            worst_loss = worst_grad = 0.0
            for index, grad, weight_grad, logged, _ in spawn(tp._loss_worker, cp, loss_type, depth, s, lengths, pad, cp=cp):
                ref_grad, ref_wgrad, ref_tv = tp._reference_for_rank(loss_type, depth, s, index, bounds)
                worst_loss = max(worst_loss, (logged.double() - ref_tv).abs().max().item())
                worst_grad = max(worst_grad, (grad.double() - ref_grad).abs().max().item(),
                                 (weight_grad.double() - ref_wgrad).abs().max().item())
            yield loss_type, layout, worst_loss, worst_grad


def _contiguous_rows():
    """Contiguous packed CP=2 (NVIDIA dev's layout), every registered loss, depth 3."""
    lengths = tp.CONTIGUOUS_LENGTHS[0]
    for loss_type in sorted(tp.LOSSES):
        worst_loss = worst_grad = 0.0
        out = spawn(tp._contiguous_worker, 2, loss_type, 3, lengths, cp=2)
        for (index, grad, weight_grad, logged, _), _, _ in out:
            ref_grad, ref_wgrad, ref_tv = tp._reference_for_rank(
                loss_type, 3, sum(lengths), index, tp._bounds(lengths))
            worst_loss = max(worst_loss, (logged.double() - ref_tv).abs().max().item())
            worst_grad = max(worst_grad, (grad.double() - ref_grad).abs().max().item(),
                             (weight_grad.double() - ref_wgrad).abs().max().item())
        yield loss_type, 'packed + CP=2 contiguous (dev)', worst_loss, worst_grad


def main():
    print('| loss | layout | max abs diff, per-depth loss | max abs diff, gradients |')
    print('|---|---|---|---|')
    for row in list(_model_rows()) + list(_loss_rows()) + list(_contiguous_rows()):
        print('| {} | {} | {:.1e} | {:.1e} |'.format(*row))


if __name__ == '__main__':
    main()
