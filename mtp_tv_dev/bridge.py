"""Megatron-Bridge on a CPU (tests only; never imported by product code).

Megatron-Bridge 0.6.2 (installed ``--no-deps`` with ``omegaconf``, ``einops`` and transformers
<= 5.12.1, ``requirements-hf.txt``) is written for GPU nodes with Transformer Engine. Three
things need help on a CPU, each handled here and nowhere in the package:

* ``megatron.bridge.peft.lora_layers`` runs ``import transformer_engine.pytorch as te`` at import
  time (``import megatron.bridge`` reaches it through the conversion code). :func:`import_bridge`
  imports ``megatron.bridge`` with a stand-in ``transformer_engine`` module in ``sys.modules``
  that holds only the names that module reads at import (``Linear``, ``LayerNormLinear``,
  ``ops.Sequential``, classes nothing is an instance of) and removes the stand-in again, so
  code imported later still sees no Transformer Engine. megatron-core and ``megatron.training``
  are imported first, so their own "is TE there?" checks run without it.
* Providers default to TE/GPU settings: :func:`cpu_provider_settings` sets the local
  (non-TE) layer spec, ``AttnBackend.local``, CPU initialisation and turns the fusions off.
* Bridge's ``mtp_block_spec`` always asks for the TE MTP spec: :func:`local_mtp_block_spec`
  swaps in ``get_gpt_mtp_block_spec(..., use_transformer_engine=False)`` while a model is
  provided.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator


class _NotTransformerEngine:
    """A class no object is an instance of: ``isinstance(x, te.Linear)`` stays False."""


def _stand_in_modules() -> dict:
    te = types.ModuleType('transformer_engine')
    te.__doc__ = 'Stand-in for megatron.bridge.peft.lora_layers on a CPU (mtp_tv_dev.bridge).'
    pytorch = types.ModuleType('transformer_engine.pytorch')
    ops = types.ModuleType('transformer_engine.pytorch.ops')
    pytorch.Linear = type('Linear', (_NotTransformerEngine,), {})
    pytorch.LayerNormLinear = type('LayerNormLinear', (_NotTransformerEngine,), {})
    ops.Sequential = type('Sequential', (_NotTransformerEngine,), {})
    pytorch.ops = ops
    te.pytorch = pytorch
    return {'transformer_engine': te, 'transformer_engine.pytorch': pytorch,
            'transformer_engine.pytorch.ops': ops}


def import_bridge():
    """``import megatron.bridge`` on a machine without Transformer Engine; returns the module."""
    if 'megatron.bridge' in sys.modules:
        return sys.modules['megatron.bridge']
    import megatron.core  # noqa: F401  (their TE checks must not see the stand-in)
    import megatron.training  # noqa: F401

    stand_in = _stand_in_modules()
    clash = [name for name in stand_in if name in sys.modules]
    if clash:
        raise RuntimeError(f'{clash} already imported: use the real Transformer Engine')
    sys.modules.update(stand_in)
    try:
        import megatron.bridge
    finally:
        for name in stand_in:
            sys.modules.pop(name, None)
    return megatron.bridge


def cpu_provider_settings(provider) -> None:
    """Point a Bridge ``GPTModelProvider`` at the local spec and CPU-safe settings."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend

    provider.transformer_layer_spec = get_gpt_layer_local_spec(
        normalization=provider.normalization, qk_layernorm=provider.qk_layernorm
    )
    provider.attention_backend = AttnBackend.local
    provider.use_cpu_initialization = True
    provider.perform_initialization = True
    provider.gradient_accumulation_fusion = False
    provider.persist_layer_norm = False
    provider.masked_softmax_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0


@contextlib.contextmanager
def local_mtp_block_spec() -> Iterator[None]:
    """While inside, Bridge's ``provide()`` builds the MTP block from the local spec."""
    from megatron.bridge.models import gpt_provider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    original = gpt_provider.mtp_block_spec

    def mtp_block_spec(config, vp_stage=None):
        if not getattr(config, 'mtp_num_layers', None):
            return None
        return get_gpt_mtp_block_spec(
            config, config.transformer_layer_spec, use_transformer_engine=False, vp_stage=vp_stage
        )

    gpt_provider.mtp_block_spec = mtp_block_spec
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = original
