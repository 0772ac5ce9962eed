"""The frozen backbone's states, computed once, and a heads-only training step through the plugin.

Every arm trains only the MTP heads on the same frozen backbone, so the decoder's output for a
window of text is the same for every arm, every step and every evaluation: :func:`cache_states`
computes it once (the 30-layer forward is most of the cost of a step otherwise). A training step
then runs what ``GPTModel._postprocess`` runs after the decoder, and nothing else:

1. the MTP block's layers on the cached states (``rotary_pos_emb`` included: SmolLM2 is a rope
   model), giving the concatenation ``[(1+D)*s, b, h]`` that ``GPTModel`` passes on;
2. ``process_mtp_loss`` of ``megatron.core.models.gpt.gpt_model`` -- the plugin's dispatcher once
   :func:`megatron.mtp_tv.install` ran: Megatron's own cross-entropy for ``'ce'``, the plugin's
   chunked sweep for every other ``mtp_loss_type`` -- which attaches the MTP loss to the main
   chunk through ``MTPLossAutoScaler``;
3. backward through that chunk. The main model's cross-entropy is never computed: the backbone
   is frozen, nobody would use it (its gradient is zero for the heads), and its ``[s, b, V]``
   logits would cost as much as one depth's.
"""

from typing import Dict, List, Optional

import torch
from tqdm.auto import tqdm

from cpu_demo_lib.model import main_states, mtp_depth_forward


@torch.no_grad()
def cache_states(model, windows: torch.Tensor, batch_size: int, label: str) -> torch.Tensor:
    """The main decoder's output (after its final norm) for every window: ``[s, N, h]`` fp32.

    Args:
        windows: ``[N, s]`` token ids.
    """
    out = []
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=label, unit='batch',
                      leave=True, dynamic_ncols=True):
        out.append(main_states(model, windows[start : start + batch_size]))
    return torch.cat(out, dim=1)


def freeze_backbone(model) -> List[torch.nn.Parameter]:
    """Only the MTP heads train; returns their parameters (the tied output weight is frozen)."""
    heads = {id(p) for p in model.mtp.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in heads)
    return [p for p in model.parameters() if id(p) in heads]


def mtp_forward_loss(model, tokens: torch.Tensor, labels: torch.Tensor,
                     main: torch.Tensor) -> torch.Tensor:
    """Steps 1-2 of the module docstring: the main chunk ``[s, b, h]`` with the MTP loss attached.

    Args:
        tokens: ``[b, s]`` input ids; ``labels``: ``[b, s]`` (``labels[:, t] = tokens[:, t+1]``).
        main: ``[s, b, h]`` the cached decoder output for ``tokens``.
    """
    from megatron.core.models.gpt import gpt_model

    hidden = [main]
    for depth in range(model.config.mtp_num_layers):
        hidden.append(mtp_depth_forward(model, depth, hidden[-1], tokens))
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights else None)
    return gpt_model.process_mtp_loss(
        hidden_states=torch.cat(hidden, dim=0), labels=labels,
        loss_mask=torch.ones_like(labels, dtype=torch.float), output_layer=model.output_layer,
        output_weight=weight, runtime_gather_output=None, is_training=True,
        compute_language_model_loss=model.compute_language_model_loss, config=model.config,
        cp_group=model.pg_collection.cp, tp_group=model.tp_group, packed_seq_params=None,
        scale_logits_fn=None, input_ids=tokens,
    )


def train_step(model, optimizer, tokens: torch.Tensor, labels: torch.Tensor, main: torch.Tensor,
               clip: Optional[float]) -> Dict[str, float]:
    """One optimiser step of the heads on cached states; returns ``grad_norm`` (before clipping,
    over every head parameter) and ``mtp_loss`` (the tracker's mean over depths).

    ``clip`` None: no clipping (the demo's default, see ``smollm2_demo.py --clip``).
    """
    from cpu_demo_lib.model import mtp_tracker_losses

    model.train()
    optimizer.zero_grad(set_to_none=True)
    out = mtp_forward_loss(model, tokens, labels, main)
    # MTPLossAutoScaler's backward sends the MTP loss its own gradient whatever reaches `out`;
    # the main chunk itself carries no loss here.
    out.backward(torch.zeros_like(out))
    params = [p for g in optimizer.param_groups for p in g['params'] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, float('inf') if clip is None else clip)
    optimizer.step()
    losses = mtp_tracker_losses()
    return {'grad_norm': float(norm),
            'mtp_loss': float('nan') if losses is None else float(losses.mean())}
