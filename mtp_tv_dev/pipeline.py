"""Megatron's own pipeline schedules on gloo CPU ranks (tests only).

:func:`run_schedule` runs one training step of ``len(batches)`` micro-batches through
``get_forward_backward_func()`` (1F1B across stages, or no pipelining on one), with
``pretrain_gpt.py``'s loss function. Two CUDA calls of the schedule code have nothing to do on a
CPU and are redirected for the duration (see :class:`_TorchOnCpu`). :func:`build_stage_gpt`
builds this stage's ``GPTModel`` (local spec, rotary positions), :func:`init_pipeline` the
parallel state with the embedding group Megatron-LM's ``pretrain_gpt.get_embedding_ranks`` makes.
"""

from __future__ import annotations

import functools
from typing import List, Sequence

import torch

__all__ = [
    "build_stage_gpt", "init_pipeline", "one_stage_name", "run_schedule", "use_training_grad_hooks",
]


def build_stage_gpt(config, tie: bool, vocab_size: int, seq_length: int, pre_process: bool = True,
                    post_process: bool = True):
    """This stage's ``GPTModel`` with MTP (local spec, rope), seeded: the same weights for the
    same config at any pipeline size (stages copy the one-stage model's by name)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mtp_tv_dev.distributed import seed_everything

    layer_spec = get_gpt_layer_local_spec()
    seed_everything(1234)
    # The copies of the word embedding on other stages are synced to the first stage's by an
    # all-reduce of `weight.data.cuda()` (LanguageModule.setup_embeddings_and_output_layer):
    # on a CPU the tensor stays where it is.
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        return GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=vocab_size,
            max_sequence_length=seq_length, pre_process=pre_process, post_process=post_process,
            mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False),
            share_embeddings_and_output_weights=tie, position_embedding_type='rope',
            parallel_output=True,
        )
    finally:
        torch.Tensor.cuda = saved


def one_stage_name(model, name: str, tie: bool):
    """The one-stage model's name of this stage's parameter ``name``; None for the last stage's
    tied output-layer copy where the MTP layers are on that stage too (the output layer is then
    handed their embedding copy, and its own weight goes unused)."""
    if name.startswith('decoder.layers.'):
        local = int(name.split('.')[2])
        rest = name.split('.', 3)[3]
        return f'decoder.layers.{model.decoder.layers[local].layer_number - 1}.{rest}'
    if name == 'output_layer.weight' and tie:
        return None if getattr(model, 'mtp_process', False) else 'embedding.word_embeddings.weight'
    return name


def init_pipeline(pp: int, embedding_stages: Sequence[int]) -> None:
    """Megatron's parallel state with PP=``pp`` on this world, the embedding group the stages
    ``embedding_stages`` (first, MTP, and last when tied: ``pretrain_gpt.get_embedding_ranks``)."""
    from megatron.core import parallel_state

    from mtp_tv_dev.distributed import reset_megatron_state, seed_everything

    def embedding_ranks(pp_ranks, *args):
        return sorted({pp_ranks[stage] for stage in embedding_stages})

    reset_megatron_state()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, create_gloo_process_groups=False,
        get_embedding_ranks=embedding_ranks,
    )
    seed_everything(1234)


def _forward_step(data_iterator, model):
    from mtp_tv_dev.cpu import causal_attention_mask

    tokens, labels, mask = next(data_iterator)
    batch, seq = tokens.shape
    output = model(input_ids=tokens, position_ids=torch.arange(seq).unsqueeze(0).expand(batch, seq),
                   attention_mask=causal_attention_mask(seq), labels=labels, loss_mask=mask)
    return output, functools.partial(_loss_func, mask)


def _loss_func(mask, losses):
    """pretrain_gpt's loss function: summed masked loss and the token count (the schedule
    divides by both and by the number of micro-batches)."""
    loss = (losses.float() * mask).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {'lm loss': (loss.detach() / tokens).clone()}


class _TorchOnCpu:
    """``torch`` as the schedules module sees it, with ``device='cuda'`` allocations on the CPU
    (``schedules.py`` allocates its token counter with ``device="cuda"``)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device='cpu' if device == 'cuda' else device, **kwargs)


def use_training_grad_hooks(ddp_model) -> None:
    """What Megatron-LM's ``training.py`` sets on the config of a DDP-wrapped model (with its
    default ``align_grad_reduce=True``): under ``overlap_grad_reduce`` the schedule delays the
    gradient sync to the last micro-batch and starts it at the end of the cooldown, and
    ``finalize_model_grads`` ends every step (deferred embedding weight gradients, the DP
    reduce, the word-embedding all-reduce over stages)."""
    from megatron.core.distributed import finalize_model_grads

    config = ddp_model.config
    if ddp_model.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp_model.no_sync
        config.grad_sync_func = ddp_model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads


def run_schedule(model, batches: List[tuple]) -> list:
    """Megatron's own schedule for this parallel state, one step of ``len(batches)``
    micro-batches ``(tokens, labels, loss_mask)`` on the CPU; returns what the last stage's loss
    function reported."""
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    batch, seq = batches[0][0].shape
    saved_torch, saved_sync = schedules.torch, torch.cuda.synchronize
    schedules.torch = _TorchOnCpu()
    # p2p_communication synchronises CUDA after exchanging shapes (mtp_standalone): nothing to
    # wait for on a CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        return get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=batch,
            forward_only=False,
        )
    finally:
        schedules.torch, torch.cuda.synchronize = saved_torch, saved_sync
