#!/usr/bin/env python3
"""Gradient error of the draft losses in bf16 / fp16 against float64, beside Megatron CE's own.

    .venv/bin/python tools/grad_precision.py                         # bf16 and fp16, 1k-8k tokens
    .venv/bin/python tools/grad_precision.py --tokens 1024 --dtypes fp16 --losses tv,kl
    .venv/bin/python tools/grad_precision.py --cold --tokens 1024,4096 --losses tv,nla  # fresh heads

One depth, one micro-batch of ``tokens`` positions. The inputs (draft and main hidden states
after the final norm, the output weight) are drawn once, rounded to the model dtype, and then
used by everything: the package's loss, Megatron's MTP cross-entropy path (the output layer's
product in the model dtype, then ``vocab_parallel_cross_entropy``, which upcasts to fp32) and
float64 references of both computed from the same rounded values. Both sides are normalised as
Megatron's ``process_mtp_loss`` does (``scale * sum(mask * loss) / num_tokens``) and
differentiated through Megatron's fp16 recipe: ``(loss * loss_scale).backward()``, then the
gradients divided by the loss scale (bf16: loss scale 1). Reported: the relative Frobenius error
``|g - g_ref| / |g_ref|`` of the draft-hidden and output-weight gradients, and each loss's error
over CE's (the suite holds it to at most 2, tests/test_precision.py).
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mtp_tv_dev.reference import depth_terms, objective  # noqa: E402  (independent fp64 reference)

DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}
#: Megatron's fp16 training scales the loss (dynamically; 2**16 is a typical settled value);
#: bf16 training does not.
LOSS_SCALES = {'bf16': 1.0, 'fp16': 65536.0}
SCALE = 0.1  # mtp_loss_scaling_factor / mtp_num_layers with Megatron's default and one depth


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0,
                cold: bool = False):
    """Rounded ``(draft [t, 1, h], main [t, 1, h], weight [V, h], mask [t], labels [t])``.

    Logits have a standard deviation of about 3 (a trained LM's scale) and the draft is a noisy
    copy of the main hidden state one position ahead, so the overlap is that of a warm head;
    ``cold``: the draft is unrelated to the target, as a fresh head's (alpha 0.006-0.15, which
    puts ``'nla'``'s coefficient w / alpha at 7-160 w).
    """
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(tokens, 1, hidden, generator=g)
    noise = torch.randn(tokens, 1, hidden, generator=g)
    draft = noise if cold else torch.roll(main, -1, 0) + 0.6 * noise
    weight = torch.randn(vocab, hidden, generator=g) * (3.0 / hidden**0.5)
    mask = (torch.rand(tokens, generator=g) > 0.1).float()
    mask[-1] = 0  # the last position has no target
    with torch.no_grad():
        p = torch.softmax(torch.roll(main, -1, 0)[:, 0] @ weight.t(), -1)
    labels = torch.multinomial(p, 1, generator=g)[:, 0]
    return draft.to(dtype), main.to(dtype), weight.to(dtype), mask, labels


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp(min=1e-300))


#: How the package's loss is run: ``'own'`` projects its target from the main hidden states
#: (the fallback where no main logits exist); ``'main_logits'`` reads it from the main head's
#: logits in the model dtype, as the output layer returns them (the training path);
#: ``'logit_grads'`` also keeps the logit gradients for backward in the model dtype instead of
#: the dense fp32 weight gradient (what wide models at short sequences get).
VARIANTS = ('own', 'main_logits', 'logit_grads')

#: The name :func:`measure` gives ``'ce'`` computed by the package (``mtp_ce_chunked``).
CHUNKED_CE = 'ce_chunked'


def package_loss_error(loss_type, draft, main, weight, mask, loss_scale, chunk=0, variant='own'):
    """Relative errors (draft, weight) of ``linear_tv_loss`` in the inputs' dtype."""
    from megatron.mtp_tv.linear_tv import linear_tv_loss
    from megatron.mtp_tv.config import MTPLossOptions
    from mtp_tv_dev.models import forced_grad_storage

    if variant not in VARIANTS:
        raise ValueError(f'variant={variant!r}; expected one of {VARIANTS}')
    d, w = draft.clone().requires_grad_(), weight.clone().requires_grad_()
    weights = mask * (SCALE / mask.sum())
    token_weights = weights[:, None] if loss_type == 'e2e_tv' else weights[None, :, None]
    kwargs = {}
    if variant != 'own':
        kwargs['target_logits'] = torch.matmul(main, weight.t())  # [t, 1, V] in the model dtype
    storage = forced_grad_storage('logit_grads') if variant == 'logit_grads' else contextlib.nullcontext()
    with storage:
        out = linear_tv_loss(d[None], main, w, token_weights,
                             MTPLossOptions(loss_type, chunk_size=chunk), **kwargs)
    (out.loss * loss_scale).backward()
    d64, w64 = draft.double().requires_grad_(), weight.double().requires_grad_()
    # The target is the main model's distribution as the loss receives it: from the main
    # hidden states (exact products of the rounded inputs), or the softmax of the main logits the
    # output layer returned in the model dtype, which are what the main loss (and a verifier
    # running the model in that dtype) sees. TV's gradient 1[q < p] is discontinuous in p, so
    # measuring a bf16 target against the unrounded one would charge the target's rounding to
    # the loss: see docs/precision.md.
    alpha, kl = depth_terms(main.double(), [d64], w64, main_logits=kwargs.get('target_logits'))
    masks = mask.double()[None, :, None]
    objective(loss_type, alpha, kl, masks, SCALE).backward()
    return (
        relative_error(d.grad.float() / loss_scale, d64.grad),
        relative_error(w.grad.float() / loss_scale, w64.grad),
    )


def chunked_ce_error(draft, weight, mask, labels, loss_scale, variant='own'):
    """Relative errors (draft, weight) of the package's cross-entropy (``mtp_ce_chunked``) in the
    inputs' dtype, against the float64 cross-entropy; ``variant`` ``'logit_grads'`` keeps the
    logit gradients for backward in the model dtype (``'own'``: the dense fp32 gradients; no
    target is read, so ``'main_logits'`` is ``'own'``)."""
    from megatron.mtp_tv.linear_tv import linear_tv_loss
    from megatron.mtp_tv.losses import CrossEntropy
    from megatron.mtp_tv.config import MTPLossOptions
    from mtp_tv_dev.models import forced_grad_storage

    d, w = draft.clone().requires_grad_(), weight.clone().requires_grad_()
    token_weights = (mask * (SCALE / mask.sum()))[None, :, None]
    with forced_grad_storage('logit_grads' if variant == 'logit_grads' else 'dense'):
        out = linear_tv_loss(d[None], None, w, token_weights, MTPLossOptions(CrossEntropy()),
                             labels=labels[None, :, None])
    (out.loss * loss_scale).backward()
    d64, w64 = draft.double().requires_grad_(), weight.double().requires_grad_()
    _float64_ce(d64, w64, mask, labels).backward()
    return (
        relative_error(d.grad.float() / loss_scale, d64.grad),
        relative_error(w.grad.float() / loss_scale, w64.grad),
    )


def _float64_ce(d64, w64, mask, labels):
    logits64 = d64[:, 0] @ w64.t()
    ce64 = torch.logsumexp(logits64, -1) - logits64.gather(1, labels[:, None])[:, 0]
    return SCALE * (mask.double() * ce64).sum() / mask.sum()


def megatron_ce_error(draft, weight, mask, labels, loss_scale):
    """Relative errors (draft, weight) of Megatron's MTP cross-entropy path in the inputs' dtype."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    d, w = draft.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = torch.matmul(d, w.t())  # the output layer's product, [t, 1, V] in the model dtype
    ce = vocab_parallel_cross_entropy(logits, labels[:, None])[:, 0]
    loss = SCALE * (mask * ce).sum() / mask.sum()
    (loss * loss_scale).backward()
    d64, w64 = draft.double().requires_grad_(), weight.double().requires_grad_()
    _float64_ce(d64, w64, mask, labels).backward()
    return (
        relative_error(d.grad.float() / loss_scale, d64.grad),
        relative_error(w.grad.float() / loss_scale, w64.grad),
    )


def measure(dtype_name: str, tokens: int, losses, hidden: int = 128, vocab: int = 4096, seed: int = 0,
            cold: bool = False, variants=('own',), device: str = 'cpu'):
    """``{name: (draft_error, weight_error)}`` for ``'ce'`` and every loss in ``losses``: keyed
    by the loss name for the ``'own'`` variant, ``'<loss>/<variant>'`` for the others.
    ``'ce_chunked'`` in ``losses`` is ``'ce'`` with ``mtp_ce_chunked`` (its variants: ``'own'``,
    ``'logit_grads'``). ``device``: where the losses run (the float64 references run there too);
    on CUDA inside the caller's Megatron parallel state (Megatron's cross-entropy reads its TP
    group), on a CPU inside ``single_process``."""
    from mtp_tv_dev.distributed import single_process

    dtype, loss_scale = DTYPES[dtype_name], LOSS_SCALES[dtype_name]
    draft, main, weight, mask, labels = (
        t.to(device) for t in make_inputs(tokens, hidden, vocab, dtype, seed, cold))
    with single_process() if device == 'cpu' else contextlib.nullcontext():
        results = {'ce': megatron_ce_error(draft, weight, mask, labels, loss_scale)}
    for loss_type in losses:
        for variant in variants:
            name = loss_type if variant == 'own' else f'{loss_type}/{variant}'
            if loss_type == CHUNKED_CE:
                if variant != 'main_logits':  # no target: the same run as 'own'
                    results[name] = chunked_ce_error(draft, weight, mask, labels, loss_scale, variant)
                continue
            results[name] = package_loss_error(
                loss_type, draft, main, weight, mask, loss_scale, variant=variant
            )
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokens', default='1024,4096,8192')
    parser.add_argument('--dtypes', default='bf16,fp16')
    parser.add_argument('--losses', default='tv,e2e_tv,kl,lk,nla,' + CHUNKED_CE,
                        help=f"loss types; {CHUNKED_CE}: 'ce' with mtp_ce_chunked")
    parser.add_argument('--hidden', type=int, default=128)
    parser.add_argument('--vocab', type=int, default=4096)
    parser.add_argument('--cold', action='store_true', help="a fresh head's draft (see make_inputs)")
    parser.add_argument('--variants', default=','.join(VARIANTS),
                        help=f'subset of {",".join(VARIANTS)} (see VARIANTS)')
    args = parser.parse_args(argv)
    losses = args.losses.split(',')
    print(f'hidden {args.hidden}, vocab {args.vocab}{", cold head" if args.cold else ""}; relative '
          f'gradient error vs float64 (draft hidden / output weight), and / CE')
    print('| dtype | tokens | loss | draft | weight | draft / CE | weight / CE |')
    print('|---|---|---|---|---|---|---|')
    for dtype_name in args.dtypes.split(','):
        for tokens in map(int, args.tokens.split(',')):
            results = measure(dtype_name, tokens, losses, args.hidden, args.vocab, cold=args.cold,
                              variants=args.variants.split(','))
            ce_d, ce_w = results['ce']
            for name, (d, w) in results.items():
                print(f'| {dtype_name} | {tokens} | {name} | {d:.2e} | {w:.2e} | '
                      f'{d / ce_d:.2f} | {w / ce_w:.2f} |', flush=True)


if __name__ == '__main__':
    main()
