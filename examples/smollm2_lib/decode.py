"""Incremental decoding with a KV cache for a megatron-core ``GPTModel`` and its MTP depths.

Speculative decoding over long contexts runs the 30-layer backbone on a few new tokens per verify
step; recomputing the whole context every step would cost a full forward each time. Megatron's
own inference contexts need CUDA (their buffers and the flash-decode kernels), so this module
runs the model's *own modules* (norms, ``linear_qkv`` and its head layout, ``linear_proj``, the
MLP, the MTP layers' ``enorm``/``hnorm``/``eh_proj``/final norm) and replaces only the core
attention: new queries attend to cached keys and values, with rope applied at each token's
absolute position. ``tests/test_smollm2_decode.py`` holds it equal to the full forward of
``GPTModel`` (the cached-states helpers of ``cpu_demo_lib.model``).

Every call takes a ragged batch: row ``b`` writes its ``m`` new tokens at its own positions
``positions[b]`` (consecutive), so rows may be at different lengths, as they are after a verify
step that accepted a different number of drafts in each. A query at position ``t`` attends to
the keys at positions ``<= t``; whatever a row wrote beyond its current length earlier (rejected
drafts, padding) is overwritten before it is read, because each call writes every position from
its first new one up.

Layout: hidden states are Megatron's ``[m, B, h]``; tokens and positions ``[B, m]``.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from cpu_demo_lib.model import mtp_layer


@dataclass
class LayerCache:
    """Keys and values of one attention layer: ``[B, groups, capacity, head_dim]`` each."""

    key: Tensor
    value: Tensor

    @classmethod
    def empty(cls, layer, batch: int, capacity: int) -> 'LayerCache':
        attn = layer.self_attention
        groups = attn.num_query_groups_per_partition
        head_dim = attn.hidden_size_per_attention_head
        shape = (batch, groups, capacity, head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape))

    def clone(self) -> 'LayerCache':
        return LayerCache(self.key.clone(), self.value.clone())


def _rotary(model, capacity: int) -> Optional[Tensor]:
    """``[capacity, 1, 1, d]`` rope angles of positions ``0 .. capacity-1`` (None without rope)."""
    if getattr(model, 'position_embedding_type', None) != 'rope':
        return None
    return model.rotary_pos_emb(capacity)


def attention_layer_step(layer, hidden: Tensor, cache: LayerCache, positions: Tensor,
                         rotary: Optional[Tensor]) -> Tensor:
    """One ``TransformerLayer`` (local spec, pre-norm, no dropout) on new tokens.

    Args:
        layer: a megatron-core ``TransformerLayer``.
        hidden: ``[m, B, h]`` its input at the new tokens.
        cache: the layer's keys and values; positions ``positions[b]`` of row ``b`` are written.
        positions: ``[B, m]`` int64 absolute positions of the new tokens.
        rotary: :func:`_rotary` of the model (None: no rope).

    Returns:
        ``[m, B, h]`` the layer's output at the new tokens.
    """
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    attn = layer.self_attention
    config = attn.config
    query, key, value = attn.get_query_key_value_tensors(layer.input_layernorm(hidden))
    # query [m, B, heads, d]; key, value [m, B, groups, d]
    if rotary is not None:
        angles = rotary[positions.t()].squeeze(-2)  # [m, B, 1, d]: each token at its own position
        query = apply_rotary_pos_emb(query, angles, config=config)
        key = apply_rotary_pos_emb(key, angles, config=config)
    rows = torch.arange(positions.shape[0]).unsqueeze(1)  # [B, 1]
    cache.key[rows, :, positions] = key.permute(1, 0, 2, 3)  # [B, m, groups, d] into [B, g, L, d]
    cache.value[rows, :, positions] = value.permute(1, 0, 2, 3)
    context = _grouped_attention(query, cache, positions, attn.core_attention.softmax_scale)
    out, bias = attn.linear_proj(context)
    hidden = hidden + (out if bias is None else out + bias)
    mlp_out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
    return hidden + (mlp_out if bias is None else mlp_out + bias)


def _grouped_attention(query: Tensor, cache: LayerCache, positions: Tensor, scale: float) -> Tensor:
    """Causal attention of new queries ``[m, B, heads, d]`` to the cache; ``[m, B, heads * d]``.

    Megatron orders the query heads by group (head ``i`` reads key group ``i // (heads /
    groups)``), so the queries of one group are stacked against its keys instead of copying the
    cache once per query head.
    """
    m, batch, heads, dim = query.shape
    groups, capacity = cache.key.shape[1], cache.key.shape[2]
    per_group = heads // groups
    q = query.permute(1, 2, 0, 3).reshape(batch, groups, per_group * m, dim)
    visible = torch.arange(capacity) <= positions.unsqueeze(-1)  # [B, m, L]
    mask = visible.unsqueeze(1).expand(batch, per_group, m, capacity).reshape(
        batch, 1, per_group * m, capacity)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, cache.key, cache.value, attn_mask=mask, scale=scale)  # [B, groups, per_group * m, d]
    return out.view(batch, heads, m, dim).permute(2, 0, 1, 3).reshape(m, batch, heads * dim)


class DecoderCache:
    """The main decoder's KV cache for ``B`` rows of up to ``capacity`` tokens."""

    def __init__(self, model, batch: int, capacity: int):
        self.model = model
        self.capacity = capacity
        self.rotary = _rotary(model, capacity)
        self.layers = [LayerCache.empty(layer, batch, capacity) for layer in model.decoder.layers]

    def _with_layers(self, layers: List[LayerCache]) -> 'DecoderCache':
        out = object.__new__(DecoderCache)
        out.model, out.capacity, out.rotary, out.layers = self.model, self.capacity, self.rotary, layers
        return out

    def clone(self) -> 'DecoderCache':
        return self._with_layers([c.clone() for c in self.layers])

    @staticmethod
    def concat(parts: List['DecoderCache']) -> 'DecoderCache':
        """One cache holding the rows of ``parts`` in order (prefilled batch by batch)."""
        return parts[0]._with_layers([
            LayerCache(torch.cat([p.layers[i].key for p in parts]),
                       torch.cat([p.layers[i].value for p in parts]))
            for i in range(len(parts[0].layers))])

    @torch.no_grad()
    def extend(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Run the decoder on new tokens; returns its output after the final norm ``[m, B, h]``
        (what ``GPTModel`` projects to logits and passes to the MTP block).

        Args:
            tokens: ``[B, m]`` ids; positions: ``[B, m]`` their absolute positions.
        """
        _check_room(positions, self.capacity)
        hidden = self.model.embedding(input_ids=tokens, position_ids=positions)  # [m, B, h]
        for layer, cache in zip(self.model.decoder.layers, self.layers):
            hidden = attention_layer_step(layer, hidden, cache, positions, self.rotary)
        return self.model.decoder.final_layernorm(hidden)


class MTPDepthCache:
    """One MTP depth's KV cache; :meth:`extend` runs the depth on new positions.

    Depth ``k`` at position ``t`` reads the previous depth's output at ``t`` (the main decoder's
    for ``k = 0``) and the embedding of token ``t + k + 1``: the caller passes both.
    """

    def __init__(self, model, depth: int, batch: int, capacity: int):
        self.model = model
        self.layer = mtp_layer(model, depth)  # one cache per depth, also for a shared layer
        self.capacity = capacity
        self.rotary = _rotary(model, capacity)
        self.cache = LayerCache.empty(self.layer.mtp_model_layer, batch, capacity)

    @torch.no_grad()
    def extend(self, previous: Tensor, next_tokens: Tensor, positions: Tensor) -> Tensor:
        """Args: previous ``[m, B, h]``; next_tokens ``[B, m]`` (token ``t + k + 1`` at each
        position ``t``); positions ``[B, m]``. Returns the depth's output ``[m, B, h]`` (after its
        final norm: the logits are ``output_layer`` of it)."""
        _check_room(positions, self.capacity)
        embedded = self.model.embedding(input_ids=next_tokens, position_ids=positions)
        hidden = self.layer._concat_embeddings(previous, embedded)  # enorm, hnorm, eh_proj
        hidden = attention_layer_step(self.layer.mtp_model_layer, hidden, self.cache, positions,
                                      self.rotary)
        return self.layer._postprocess(hidden)  # the depth's final norm


def _check_room(positions: Tensor, capacity: int) -> None:
    if positions.numel() and int(positions.max()) >= capacity:
        raise ValueError(f'position {int(positions.max())} is beyond the cache capacity '
                         f'{capacity}; build the cache with a larger capacity')


@torch.no_grad()
def logits(model, hidden: Tensor) -> Tensor:
    """``[..., V]`` fp32 logits of hidden states through the (shared) output layer."""
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights else None)
    out, _ = model.output_layer(hidden, weight=weight)
    return out.float()


def arange_positions(start: Tensor, count: int) -> Tensor:
    """``[B, count]`` positions ``start[b] .. start[b] + count - 1``."""
    return start.unsqueeze(1) + torch.arange(count)


def gather_steps(store: Tensor, positions: Tensor) -> Tensor:
    """``store[positions[b, i], b]`` for ``store`` ``[L, B, ...]``: ``[m, B, ...]``."""
    rows = torch.arange(positions.shape[0]).unsqueeze(1)
    return store[positions, rows].transpose(0, 1)


def scatter_steps(store: Tensor, positions: Tensor, values: Tensor) -> None:
    """``store[positions[b, i], b] = values[i, b]`` (the inverse of :func:`gather_steps`)."""
    rows = torch.arange(positions.shape[0]).unsqueeze(1)
    store[positions, rows] = values.transpose(0, 1)

