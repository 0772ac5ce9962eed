"""Pipeline layouts with the MTP layers on an earlier stage than the loss, every loss.

megatron-core 0.19.2's ``pipeline_model_parallel_layout`` may place the MTP layers (``m``) on
any stage whose decoder layers (``t``) all come before them, not only on the stage that holds
the output layer and the loss (``L``): ``PipelineParallelLayerLayout.validate_layer_layout``
(``transformer/pipeline_parallel_layer_layout.py``) checks only that no decoder layer follows an
MTP layer, that the MTP layers share one (the last virtual) stage of their rank, and returns
``mtp_standalone=True`` when that rank is not the last. The MTP stage then builds the MTP block
and a copy of the word embedding (``GPTModel.__init__``: ``mtp_process``), runs it in
``_postprocess`` and, not being ``post_process``, hands the ``[(1+D)s, b, h]`` concatenation to
the next stage (``mtp_standalone`` makes the schedule exchange tensor shapes first,
``pipeline_parallel/p2p_communication.py``). The last stage's decoder is empty; its
``_postprocess`` calls ``process_mtp_loss`` on what crossed the pipeline, and the loss's
gradient travels back through the MTP layers to the embedding copies on the MTP stage and the
first stage (and, tied, to the output-layer copy on the last stage).

Held here on gloo CPU ranks, through Megatron's own 1F1B schedule
(``forward_backward_pipelining_without_interleaving``, two micro-batches), against the same
model, weights and batches on one stage (Megatron's ``forward_backward_no_pipelining``): the
loss of each micro-batch, the per-depth MTP loss Megatron logs, and the gradient of every
parameter. Word-embedding copies are summed over the stages that hold one, as
``finalize_model_grads`` all-reduces them over the embedding group (built, as Megatron-LM's
``pretrain_gpt.get_embedding_ranks`` builds it, from the first stage, the last stage when the
output weight is tied, and the MTP stage). Layouts: PP=2 ``Ettm|L`` (one depth, MTP on the
first stage beside the embedding), PP=3 ``Et|tmm|L`` (two depths on a middle stage with the
final norm) and PP=3 ``Et|mm|L`` (two depths on a middle stage with no decoder layer); every
loss, tied and untied output weights. Rotary positions, as real MTP models use: with learned
absolute positions a middle MTP stage holds a second copy of the position embedding, which
``setup_embeddings_and_output_layer`` does not sync (only the word embedding) and
``finalize_model_grads`` does not all-reduce (the position-embedding group is the first stage
only, ``parallel_state.default_position_embedding_ranks``): a megatron-core matter outside the
loss, which sees only the hidden states.
"""

import contextlib

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import spawn
from mtp_tv_dev.pipeline import build_stage_gpt, init_pipeline, one_stage_name, run_schedule

megatron.mtp_tv.install()

VOCAB, HIDDEN, HEADS, SEQ, BATCH, MICRO, FACTOR = 64, 32, 4, 16, 2, 2, 0.3
LOSS_TYPES = ['ce'] + list(LOSSES)
# name: (PP size, layout, decoder layers, MTP depths, stage holding the MTP layers)
LAYOUTS = {
    'pp2_Ettm|L': (2, 'Ettm|L', 2, 1, 0),
    'pp3_Et|tmm|L': (3, 'Et|tmm|L', 2, 2, 1),
    'pp3_Et|mm|L': (3, 'Et|mm|L', 1, 2, 1),
}
TIES = (True, False)
WORD = 'embedding.word_embeddings.weight'


def _config(num_layers, depth, loss_type, pp=1, layout=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if pp > 1:
        extra = dict(pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=layout,
                     pipeline_dtype=torch.float32)
    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        mtp_num_layers=depth, mtp_loss_type=loss_type, mtp_tv_chunk=5,
        mtp_loss_scaling_factor=FACTOR, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False, **extra,
    )


def _batches():
    from mtp_tv_dev.models import random_batch

    return [random_batch(VOCAB, SEQ, BATCH, seed=10 + i) for i in range(MICRO)]


def _logged():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = MTPLossLoggingHelper.tracker.get('loss_values')
    return None if values is None else values.detach().clone()


def _reference(name, tie, loss_type):
    """One stage: the weights (by name), the losses, the logged MTP losses and the gradients."""
    from mtp_tv_dev.distributed import reset_mtp_tracker, run_single_process

    def run(rank):
        _, _, num_layers, depth, _ = LAYOUTS[name]
        model = build_stage_gpt(_config(num_layers, depth, loss_type), tie, VOCAB, SEQ)
        reset_mtp_tracker()
        losses = run_schedule(model, _batches())
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        return weights, [d['lm loss'] for d in losses], _logged(), grads

    return run_single_process(run)


@contextlib.contextmanager
def _loss_inputs_seen():
    """While open, the shape of every ``hidden_states`` that ``GPTModel._postprocess`` hands
    to the MTP loss, and whether it carries a gradient: to ``process_mtp_loss`` (the plugin's
    dispatcher, which it calls by that name), or in a patched tree, where the loss runs on the
    main logits, to ``split_mtp_hidden_states``."""
    from megatron.core.models.gpt import gpt_model

    seen, saved = [], {}

    def spy(original):
        def wrapped(hidden_states, *args, **kwargs):
            seen.append((tuple(hidden_states.shape), hidden_states.requires_grad))
            return original(hidden_states, *args, **kwargs)
        return wrapped

    for name in ('process_mtp_loss', 'split_mtp_hidden_states'):
        if name in gpt_model.__dict__:  # the split: patch mode only
            saved[name] = gpt_model.__dict__[name]
            setattr(gpt_model, name, spy(saved[name]))
    try:
        yield seen
    finally:
        for name, original in saved.items():
            setattr(gpt_model, name, original)


def _pipeline_worker(rank, pp, names, references):
    """Every (layout, tie, loss) of ``names`` on this PP world; per case this stage's losses,
    logged MTP losses and gradients keyed by the one-stage model's parameter names."""
    from megatron.core import parallel_state

    from mtp_tv_dev.distributed import reset_mtp_tracker

    megatron.mtp_tv.install()
    out = {}
    for tie in TIES:
        stages = {LAYOUTS[name][4] for name in names}
        assert len(stages) == 1, 'one embedding group per world: one MTP stage'
        mtp_stage = stages.pop()
        init_pipeline(pp, [0, mtp_stage] + ([pp - 1] if tie else []))
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
        for name in names:
            _, layout, num_layers, depth, _ = LAYOUTS[name]
            for loss_type in LOSS_TYPES:
                weights = references[name, tie, loss_type][0]
                config = _config(num_layers, depth, loss_type, pp, layout)
                assert config.mtp_standalone  # MTP on an earlier stage than the loss
                model = build_stage_gpt(config, tie, VOCAB, SEQ, pre_process=first,
                                        post_process=last)
                synced = (model.embedding.word_embeddings.weight.detach().clone()
                          if hasattr(model, 'embedding') else None)
                with torch.no_grad():
                    for param_name, param in model.named_parameters():
                        param.copy_(weights[one_stage_name(model, param_name, tie)])
                reset_mtp_tracker()
                with _loss_inputs_seen() as seen:
                    losses = run_schedule(model, _batches())
                grads = {}
                for param_name, param in model.named_parameters():
                    assert param.grad is not None, f'stage {rank}: no gradient for {param_name}'
                    grads[one_stage_name(model, param_name, tie)] = param.grad.detach().clone()
                out[name, tie, loss_type] = dict(
                    losses=[d['lm loss'] for d in losses] if last else None,
                    logged=_logged() if last else None, grads=grads,
                    mtp=getattr(model, 'mtp_process', False), synced=synced, seen=seen,
                    post_process=last, pre_process=first,
                )
    return out


def _check(name, results, references):
    pp, _, _, depth, mtp_stage = LAYOUTS[name]
    for tie in TIES:
        for loss_type in LOSS_TYPES:
            msg = f'{name}, {"tied" if tie else "untied"}, {loss_type}'
            weights, ref_losses, ref_logged, ref_grads = references[name, tie, loss_type]
            stages = [r[name, tie, loss_type] for r in results]
            # The MTP layers are on their stage only, and not on the loss's.
            assert [s['mtp'] for s in stages] == [i == mtp_stage for i in range(pp)], msg
            assert not any(n.startswith('mtp.') for n in stages[-1]['grads']), msg
            # Megatron's own set-up synced every embedding copy to the first stage's.
            for stage in stages[1:]:
                if stage['synced'] is not None:
                    torch.testing.assert_close(stage['synced'], stages[0]['synced'], msg=msg)
            last = stages[-1]
            # The loss ran on the last stage only, once per micro-batch, on the [(1+D)s, b, h]
            # hidden states that crossed the pipeline, in the autograd graph.
            assert all(not s['seen'] for s in stages[:-1]), msg
            assert last['seen'] == [(((1 + depth) * SEQ, BATCH, HIDDEN), True)] * MICRO, msg
            assert len(last['losses']) == MICRO
            for loss, ref in zip(last['losses'], ref_losses):
                torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6, msg=msg)
            assert ref_logged is not None and ref_logged.shape == (depth,), msg
            torch.testing.assert_close(last['logged'], ref_logged, rtol=1e-5, atol=1e-6, msg=msg)
            # Every gradient; the word-embedding copies summed (finalize_model_grads).
            summed = {}
            for stage in stages:
                for param_name, grad in stage['grads'].items():
                    if param_name in summed:
                        assert param_name == WORD, f'{msg}: {param_name} on two stages'
                        summed[param_name] = summed[param_name] + grad
                    else:
                        summed[param_name] = grad
            assert summed.keys() == ref_grads.keys(), msg
            for param_name, ref in ref_grads.items():
                torch.testing.assert_close(summed[param_name], ref, rtol=1e-5, atol=1e-5,
                                           msg=f'{msg}: {param_name}')
            for param_name in ref_grads:
                if param_name.startswith('mtp.') and param_name.endswith('eh_proj.weight'):
                    assert ref_grads[param_name].abs().sum() > 0, f'{msg}: {param_name}'
            if not tie:  # the output weight is the last stage's own
                assert 'output_layer.weight' in last['grads'], msg
            del weights
        # Each loss is its own objective (the dispatcher fell back to none of them): the first
        # MTP layer's gradients differ (at one depth 'e2e_tv' is 'tv', 1 - alpha_1).
        grads = [references[name, tie, loss_type][3]['mtp.layers.0.eh_proj.weight']
                 for loss_type in LOSS_TYPES]
        for i in range(len(grads)):
            for j in range(i):
                if depth == 1 and {LOSS_TYPES[i], LOSS_TYPES[j]} == {'tv', 'e2e_tv'}:
                    continue
                assert not torch.allclose(grads[i], grads[j]), (
                    f'{name}: {LOSS_TYPES[i]} has the gradient of {LOSS_TYPES[j]}')


@pytest.mark.parametrize('pp', [2, 3])
def test_mtp_before_the_loss_stage_matches_one_stage(pp):
    names = [name for name, spec in LAYOUTS.items() if spec[0] == pp]
    references = {(name, tie, loss_type): _reference(name, tie, loss_type)
                  for name in names for tie in TIES for loss_type in LOSS_TYPES}
    results = spawn(_pipeline_worker, pp, pp, names, references, timeout=300)
    for name in names:
        _check(name, results, references)
