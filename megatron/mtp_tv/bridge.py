"""Megatron's parsed arguments and the configs that are not built from them.

Megatron's own path builds the model config with ``core_transformer_config_from_args``, which
copies every same-named argument, so ``--mtp-loss-type tv`` reaches the model. A Megatron-Bridge
provider (a ``TransformerConfig`` subclass that ``AutoBridge.to_megatron_provider()`` fills from a
Hugging Face config) is not built that way: miles' bridge mode (``--megatron-to-hf-mode bridge``)
copies a fixed list of arguments onto it (parallelism, recompute, fp8, ...) and none of this
package's. Two functions close that gap. Neither imports Megatron's training side or
Megatron-Bridge, nor reads their state: the training side, which owns the parsed arguments, tells
this module where they are (:func:`set_megatron_args_source`; ``megatron/training/global_vars.py``
does it in a patched tree, :func:`megatron.mtp_tv.install` in plugin mode), and a Bridge provider
is recognised by its class in ``sys.modules``. Where neither is in use both cost nothing.

* :func:`carry_to_bridge_provider` runs in ``TransformerConfig.__post_init__`` (the plugin's
  hook, the patched source), before :func:`~.config.validate_mtp_loss_config`; a Bridge provider
  runs ``__post_init__`` in ``finalize()``.
  When the config is a Megatron-Bridge provider and Megatron's global arguments are set
  (``set_args``, which ``initialize_megatron`` and miles' ``init`` call), every field of
  :class:`~.config.MTPLossConfig` that the arguments hold with a value other than its default
  is copied onto the provider. Arguments at their default ask for nothing, so a value set on
  the provider (a Bridge recipe's ``cfg.model.mtp_loss_type``) stays;
  a provider that holds a different non-default value is a conflict and raises ``ValueError``.
* :func:`check_megatron_args` runs once per model, first in ``MultiTokenPredictionBlock.__init__``
  (the plugin's wrapper, the patched source), whatever built the config: where the arguments ask
  for a value and the config holds another, it raises ``ValueError`` naming both. That is the
  guard for every way of building a config that does not take the arguments (a config built by
  hand or before ``set_args``, a provider finalized before ``install()``), so a flag is never
  parsed and then silently dropped. The loss itself never reads Megatron's arguments.
"""

import dataclasses
import sys
from typing import Callable, Dict, Optional

from .config import MTPLossConfig, is_cross_entropy

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MTPLossConfig)}

#: Returns Megatron's parsed arguments, or None while none are set; None: no training side told
#: this module where they are (a model built without Megatron's launcher: nothing to check).
_args_source: Optional[Callable[[], Optional[object]]] = None


def set_megatron_args_source(source: Optional[Callable[[], Optional[object]]]) -> None:
    """Tell the MTP loss where Megatron's parsed arguments are.

    ``source()`` returns them, or None while none are set; it is called where a config is
    finalized and where a model's MTP block is built, so it must read the current arguments (not
    a copy: launchers also assign and clear them directly). Megatron's training side calls this
    once, when its global variables module is imported (patched trees) or at ``install()``
    (plugin mode): megatron.core never imports megatron.training.
    """
    global _args_source
    _args_source = source


def megatron_args() -> Optional[object]:
    """Megatron's parsed arguments, or None (none set, or no source told, see
    :func:`set_megatron_args_source`)."""
    return _args_source() if _args_source is not None else None


def _same(name: str, a, b) -> bool:
    if name == 'mtp_loss_type' and is_cross_entropy(a) and is_cross_entropy(b):
        return True  # 'ce' and 'cross_entropy' are one loss
    return a == b


def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def requested_fields(args) -> Dict[str, object]:
    """The MTP loss fields that ``args`` hold with a value other than the field's default."""
    return {
        name: getattr(args, name)
        for name, default in _DEFAULTS.items()
        if hasattr(args, name) and not _same(name, getattr(args, name), default)
    }


def is_bridge_provider(config) -> bool:
    """Whether ``config`` is a Megatron-Bridge model provider (without importing Bridge)."""
    module = sys.modules.get('megatron.bridge.models.model_provider')
    mixin = getattr(module, 'ModelProviderMixin', None)
    return mixin is not None and isinstance(config, mixin)


def carry_to_bridge_provider(config) -> None:
    """Copy the MTP loss fields Megatron's arguments ask for onto a Megatron-Bridge provider.

    Does nothing unless ``config`` is a Bridge provider and Megatron's global arguments are set.

    Raises:
        ValueError: the provider holds a non-default value that differs from the arguments'.
    """
    if not is_bridge_provider(config):
        return
    args = megatron_args()
    if args is None:
        return
    for name, value in requested_fields(args).items():
        held = getattr(config, name, _DEFAULTS[name])
        if not _same(name, held, _DEFAULTS[name]) and not _same(name, held, value):
            raise ValueError(
                f'{type(config).__name__}.{name}={held!r}, but Megatron\'s arguments ask for '
                f'{_flag(name)} {value!r}; set one of them, or both to the same value.'
            )
        setattr(config, name, value)


def check_megatron_args(config) -> None:
    """Raise if Megatron's arguments ask for MTP loss settings that ``config`` does not hold.

    Raises:
        ValueError: naming each differing argument, the config's value and how to fix it.
    """
    args = megatron_args()
    if args is None:
        return
    wrong = {
        name: (value, getattr(config, name, _DEFAULTS[name]))
        for name, value in requested_fields(args).items()
        if not _same(name, getattr(config, name, _DEFAULTS[name]), value)
    }
    if wrong:
        asked = ', '.join(f'{_flag(n)} {v!r}' for n, (v, _) in wrong.items())
        held = ', '.join(f'{n}={h!r}' for n, (_, h) in wrong.items())
        raise ValueError(
            f"Megatron's arguments ask for {asked}, but the model's config "
            f'({type(config).__name__}) holds {held}, so the MTP loss would not be the one asked '
            'for. The config was not built from these arguments (core_transformer_config_from_args '
            'copies them; a Megatron-Bridge provider takes them in finalize() once '
            "megatron.mtp_tv.install() and Megatron's set_args have run), or a field was assigned "
            'after construction. Set the same values on the config where it is built (e.g. '
            "provider.mtp_loss_type = 'tv' before provider.finalize()), or drop the flags."
        )
