"""The FLOPs Megatron reports: what the MTP loss adds to ``num_floating_point_operations``.

Megatron counts ``1 + D`` logit projections per token, each with its backward. The MTP loss adds
forward-only projections on two paths (docs/gpu_training.md, FLOPs): its own projection of the
target where the model does not hand it the main logits (one per token), and the acceptance
metrics of Megatron's own ``'ce'`` (target and ``D`` drafts again: ``1 + D``). The expected counts
below are written from that statement, not from the code.

Runs in both modes. Patched trees add the count in ``training.py`` (``tools/patchgen``); the
plugin does not patch ``training.py``, so there the reported count is unchanged, as the docs say.
"""

import pytest

import megatron.mtp_tv
from megatron.mtp_tv.training_args import mtp_loss_flops
from mtp_tv_dev.megatron_args import validated_args

import patch_mode

megatron.mtp_tv.install()  # a no-op in patch mode

HIDDEN, VOCAB, SEQ, BATCH, DEPTH = 64, 1024, 128, 8, 2
BASE = [
    '--num-layers', '2', '--hidden-size', str(HIDDEN), '--num-attention-heads', '4',
    '--seq-length', str(SEQ), '--max-position-embeddings', str(SEQ),
    '--position-embedding-type', 'rope', '--micro-batch-size', '1',
    '--global-batch-size', str(BATCH), '--train-iters', '10', '--lr', '1e-4', '--mock-data',
    '--tokenizer-type', 'NullTokenizer', '--vocab-size', str(VOCAB),
    '--make-vocab-size-divisible-by', '128', '--mtp-num-layers', str(DEPTH),
]

#: ``(flags, forward-only projections per token on the main-logits path, on a path where the loss
#: projects its own target)``.
CASES = [
    ([], 0, 0),
    (['--mtp-log-acceptance'], 1 + DEPTH, 1 + DEPTH),
    (['--mtp-ce-chunked'], 0, 0),
    (['--mtp-ce-chunked', '--mtp-log-acceptance'], 0, 1),
    *[(['--mtp-loss-type', loss], 0, 1) for loss in ('tv', 'e2e_tv', 'kl', 'lk', 'nla')],
    (['--mtp-loss-type', 'kl', '--mtp-log-acceptance'], 0, 1),
]


def _name(value) -> str:
    return (' '.join(value) or 'ce') if isinstance(value, list) else str(value)


def _args(flags, monkeypatch):
    args = validated_args(BASE + flags, monkeypatch)
    args.padded_vocab_size = VOCAB  # what building the tokenizer sets
    return args


def _projection_flops(projections: int) -> int:
    return 2 * BATCH * SEQ * HIDDEN * VOCAB * projections


@pytest.mark.parametrize('flags,main_logits,own', CASES, ids=lambda v: _name(v))
def test_mtp_loss_flops_counts_the_forward_only_projections(flags, main_logits, own, monkeypatch):
    args = _args(flags, monkeypatch)
    tokens = BATCH * SEQ
    assert mtp_loss_flops(args, tokens, hybrid_model=False) == _projection_flops(main_logits)
    assert mtp_loss_flops(args, tokens, hybrid_model=True) == _projection_flops(own)
    args.config_logger_dir = '/tmp/configs'  # the config logger: GPTModel hands no main logits
    assert mtp_loss_flops(args, tokens, hybrid_model=False) == _projection_flops(own)


def test_without_mtp_layers_nothing_is_added(monkeypatch):
    args = _args(['--mtp-log-acceptance'], monkeypatch)
    args.mtp_num_layers = None
    assert mtp_loss_flops(args, BATCH * SEQ, hybrid_model=True) == 0


@pytest.mark.parametrize('flags,main_logits,own', CASES[:2] + CASES[4:5], ids=lambda v: _name(v))
def test_megatron_reports_them_where_the_patch_counts(flags, main_logits, own, monkeypatch):
    """``num_floating_point_operations`` of the tree under test, against ``'ce'`` without
    metrics: the patched trees add exactly the projections above; the plugin adds nothing."""
    from megatron.training.training import num_floating_point_operations

    baseline = num_floating_point_operations(_args([], monkeypatch), BATCH)
    args = _args(flags, monkeypatch)
    args.config_logger_dir = '/tmp/configs'
    added = num_floating_point_operations(args, BATCH) - baseline
    assert added == (_projection_flops(own) if patch_mode.active() else 0)
