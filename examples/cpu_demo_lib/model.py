"""The demo's model: a real megatron-core ``GPTModel`` with MTP heads, trained through Megatron's loss.

A model is rebuilt per phase from the previous phase's weights; only its config differs:

=========  ============================  =============  ============  =======================
phase      model / trainable             mtp_loss_type  detach heads  mtp_loss_scaling_factor
=========  ============================  =============  ============  =======================
pretrain   backbone + heads, all         'ce'           no (joint)    ``--pretrain-mtp-scale``
drift      backbone alone (no MTP)       --             --            --
heal       grafted: heads only           the arm        yes           1
cold       fresh heads: heads only       the arm        yes           1
=========  ============================  =============  ============  =======================

The drift phase fine-tunes a GPTModel built without MTP heads from the pretrained backbone, as
SFT or RL does to a released model; :func:`graft` then puts the pretrained heads back on the
drifted backbone. "Backbone" is the embedding, the decoder (with its final norm) and the output
layer. Embedding and output weights are tied, as in the models MTP heads are grafted onto, so in
the heal phase the heads project through the frozen, drifted shared output weight
(``mtp_detach_heads`` also detaches it inside the MTP loss): each head owns its MTP layer (norms,
``eh_proj``, transformer layer, final norm) and nothing else. The cold phase is the heal phase
on a model whose heads were re-initialised (:func:`fresh_heads`) instead of grafted: MTP heads
added to an existing model.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .corpus import VOCAB_SIZE


@dataclass
class ModelSpec:
    hidden_size: int
    num_layers: int
    mtp_num_layers: int
    seq_length: int
    num_attention_heads: int
    seed: int


def phase_overrides(phase: str, loss_type: str, pretrain_mtp_scale: float,
                    temperature: float = 1.0, lk_eta: Optional[float] = None,
                    chunk: Optional[int] = None) -> Dict:
    """``TransformerConfig`` fields (added by the plugin or Megatron's own) for a phase.

    ``temperature`` (``mtp_tv_temperature``), ``lk_eta`` (``mtp_lk_eta``, None: the plugin's
    default) and ``chunk`` (``mtp_tv_chunk``, None: the plugin's automatic size) apply to the
    'heal' and 'cold' phases. The demo passes the micro-batch's token count, one chunk per
    micro-batch: its logits are tiny (1 MiB at a 256-token vocabulary), every chunk costs
    per-operation overhead on CPU (16 chunks made a head step 2.2x slower), and the numbers do
    not depend on the plugin's automatic rule.
    """
    if phase == 'pretrain':
        # Joint CE training as MTP models are pretrained: the MTP loss also shapes the backbone.
        return dict(mtp_loss_type='ce', mtp_detach_heads=False,
                    mtp_loss_scaling_factor=pretrain_mtp_scale)
    if phase == 'drift':
        # Fine-tuning the backbone alone, as SFT/RL of a released model does: no MTP block at
        # all, so nothing of the heads can change and no compute goes into them.
        return dict(mtp_num_layers=None)
    if phase in ('heal', 'cold'):
        # Only the heads learn, from the frozen drifted backbone. Scale 1: with Adam the scale
        # hardly matters (the heads receive no other gradient), and 1 keeps the logged loss plain.
        # mtp_log_acceptance makes the plugin log the training-time alpha for 'ce' as well.
        out = dict(mtp_loss_type=loss_type, mtp_detach_heads=True, mtp_loss_scaling_factor=1.0,
                   mtp_log_acceptance=True)
        if temperature != 1.0:  # only then: the default config stays what it was before
            out['mtp_tv_temperature'] = float(temperature)
        if lk_eta is not None:
            out['mtp_lk_eta'] = float(lk_eta)
        if chunk is not None:
            out['mtp_tv_chunk'] = int(chunk)
        return out
    raise ValueError(f'unknown phase {phase!r}')


def build_model(spec: ModelSpec, overrides: Dict, state: Optional[Dict] = None):
    """A tiny GPTModel with ``spec.mtp_num_layers`` MTP depths (local spec, CPU, tied weights)."""
    from mtp_tv_dev.models import build_gpt_with_mtp

    overrides = dict(overrides)
    mtp_num_layers = overrides.pop('mtp_num_layers', spec.mtp_num_layers)
    model = build_gpt_with_mtp(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        mtp_num_layers=mtp_num_layers,
        seq_length=spec.seq_length,
        num_attention_heads=spec.num_attention_heads,
        tie_embeddings=True,
        seed=spec.seed,
        **overrides,
    )
    if state is not None:
        model.load_state_dict(state)
    return model


def graft(backbone_state: Dict, heads_state: Dict) -> Dict:
    """A state dict with the backbone of ``backbone_state`` and the MTP heads of ``heads_state``."""
    heads = {k: v for k, v in heads_state.items() if k.startswith('mtp.')}
    if not heads:
        raise ValueError('heads_state has no MTP parameters (keys starting with "mtp.")')
    backbone = {k: v for k, v in backbone_state.items() if not k.startswith('mtp.')}
    return {**backbone, **heads}


def fresh_heads(backbone_state: Dict, spec: ModelSpec, init_seed: int) -> Dict:
    """A state dict with the backbone of ``backbone_state`` and newly initialised MTP heads.

    The heads are those of a model built with ``init_seed`` (Megatron's own initialisation);
    every cold arm starts from the same ones.
    """
    from dataclasses import replace

    fresh = build_model(replace(spec, seed=init_seed), phase_overrides('cold', 'ce', 1.0))
    return graft(backbone_state, fresh.state_dict())


def backbone_and_heads(model):
    """Split the parameters: (backbone params, MTP head params); every param in exactly one."""
    heads = list(model.mtp.parameters()) if getattr(model, 'mtp', None) is not None else []
    head_ids = {id(p) for p in heads}
    backbone = [p for p in model.parameters() if id(p) not in head_ids]
    return backbone, heads


def set_trainable(model, part: str) -> List[torch.nn.Parameter]:
    """Freeze all but ``part`` ('all', 'backbone' or 'heads'); return the trainable params."""
    backbone, heads = backbone_and_heads(model)
    train = {'all': backbone + heads, 'backbone': backbone, 'heads': heads}[part]
    train_ids = {id(p) for p in train}
    for p in model.parameters():
        p.requires_grad_(id(p) in train_ids)
    return train


def mtp_tracker_losses() -> Optional[torch.Tensor]:
    """Per-depth MTP loss of the last step from Megatron's tracker (then cleared), if any."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get('loss_values')
    out = None if values is None else values.clone()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return out


def train_step(model, optimizer, tokens: torch.Tensor, labels: torch.Tensor, clip: float = 1.0,
               stats: Optional[Dict] = None):
    """One step through Megatron's loss path; returns the main LM loss (float).

    ``stats``, if given, receives ``grad_norm``: the L2 norm of the trainable parameters'
    gradient before clipping to ``clip``.

    ``model(...)`` returns the main per-token loss ``[b, s]``; ``process_mtp_loss`` (the plugin's
    dispatcher) attached the MTP loss to the graph through ``MTPLossAutoScaler``, so backward of
    the masked mean below trains the MTP heads too.
    """
    from mtp_tv_dev.models import forward_loss

    model.train()
    mask = torch.ones_like(labels, dtype=torch.float)
    loss = forward_loss(model, tokens, labels, mask)
    main = (loss * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    main.backward()
    params = [p for g in optimizer.param_groups for p in g['params'] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if stats is not None:
        stats['grad_norm'] = float(norm)
    optimizer.step()
    return float(main.detach())


def make_optimizer(params, lr: float, steps: int):
    """AdamW with a short linear warm-up and a cosine decay to 10% of ``lr``."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rotary_pos_emb(model, seq: int) -> Optional[torch.Tensor]:
    """The rotary embedding ``GPTModel.forward`` computes for ``seq`` tokens, None without rope.

    Calling the decoder or an MTP layer directly without it runs and is silently wrong for a
    rope model (no position information at all): every helper below passes it.
    """
    if getattr(model, 'position_embedding_type', None) != 'rope':
        return None
    return model.rotary_pos_emb(seq)


@torch.no_grad()
def hidden_states(model, tokens: torch.Tensor, num_depths: int,
                  main: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Main and MTP hidden states without computing any loss: ``[main, depth_0, .., depth_{n-1}]``.

    The same submodule calls as ``GPTModel.forward`` -> ``MultiTokenPredictionBlock.forward`` for
    this model (learned absolute positions or rope, no packing), stopping after ``num_depths`` MTP
    layers, so that drafting depth k costs only the layers it needs. Each tensor is ``[s, b, h]``;
    depth k at position t has seen the tokens up to ``t + k + 1``. ``main``, if given, is the
    main decoder's output for ``tokens`` computed before (a frozen backbone's cached states): the
    decoder is then not run. (The test suite checks this against the model's own forward.)
    """
    hidden = main_states(model, tokens) if main is None else main
    out = [hidden]
    for depth in range(num_depths):
        hidden = mtp_depth(model, depth, hidden, tokens)
        out.append(hidden)
    return out


@torch.no_grad()
def main_states(model, tokens: torch.Tensor) -> torch.Tensor:
    """The main decoder's hidden states ``[s, b, h]`` (after its final norm), no loss."""
    from mtp_tv_dev.cpu import causal_attention_mask

    model.eval()
    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    embedded = model.embedding(input_ids=tokens, position_ids=position_ids)
    return model.decoder(hidden_states=embedded, attention_mask=causal_attention_mask(seq),
                         rotary_pos_emb=rotary_pos_emb(model, seq))


@torch.no_grad()
def mtp_depth(model, depth: int, previous: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One MTP depth alone: its hidden states ``[s, b, h]`` from the previous depth's.

    ``previous`` is :func:`main_states` for depth 0, else depth ``depth - 1``'s output; ``tokens``
    the whole ``[b, s]`` sequence. The layer gets the token and position ids rolled ``depth``
    times with Megatron's ``roll_tensor`` (it rolls once more itself), as
    ``MultiTokenPredictionBlock`` passes them, so chaining this over depths gives
    :func:`hidden_states`. Depth k at position t reads tokens up to ``t + k + 1`` only: speculative
    decoding calls it once per drafted token on a sequence whose later tokens are not drawn yet.
    """
    model.eval()
    return mtp_depth_forward(model, depth, previous, tokens)


def mtp_layer(model, depth: int):
    """The MTP layer that computes ``depth``: the one shared layer under
    ``mtp_use_repeated_layer`` (applied at every depth, as ``MultiTokenPredictionBlock`` does),
    else depth's own."""
    return model.mtp.layers[0 if model.config.mtp_use_repeated_layer else depth]


def mtp_depth_forward(model, depth: int, previous: torch.Tensor,
                      tokens: torch.Tensor) -> torch.Tensor:
    """:func:`mtp_depth` in the current mode and grad setting (for training on cached states)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    from mtp_tv_dev.cpu import causal_attention_mask

    batch, seq = tokens.shape
    input_ids = tokens
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    for _ in range(depth):
        input_ids, _ = roll_tensor(input_ids, shifts=-1, dims=-1)
        position_ids, _ = roll_tensor(position_ids, shifts=-1, dims=-1)
    hidden, *_ = mtp_layer(model, depth)(
        input_ids=input_ids, position_ids=position_ids, hidden_states=previous,
        attention_mask=causal_attention_mask(seq), embedding=model.embedding,
        rotary_pos_emb=rotary_pos_emb(model, seq),
    )
    return hidden


@torch.no_grad()
def project(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of hidden states ``[..., h]`` through the (shared) output layer: ``[..., V]``."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits.float()
