"""Install the TV losses into a running megatron-core (plugin mode).

:func:`install` does three things, each idempotent:

1. adds the fields of :class:`~megatron.mtp_tv.config.MTPLossConfig` to ``TransformerConfig`` and
   every already-imported dataclass subclass (re-running ``dataclasses.dataclass`` on them, so
   ``__init__``, ``fields()`` and hence Megatron's ``ArgumentGroupFactory`` and
   ``core_transformer_config_from_args`` see them), and validates them in ``__post_init__``;
2. replaces ``process_mtp_loss`` in the modules that call it (``multi_token_prediction``,
   ``gpt_model``, ``hybrid_model`` import it by name) with a dispatcher that keeps Megatron's
   function for ``'ce'``;
3. makes ``MTPLossLoggingHelper.track_mtp_metrics`` log the acceptance metrics as well.

Patch mode (``patches/``) makes the same changes in the source of a Megatron tree instead.
"""

import ast
import dataclasses
import functools
import importlib
import inspect
import threading
from typing import Callable, Dict, List

import torch

from . import config as _config

_lock = threading.Lock()
_installed = False

#: Modules that bind ``process_mtp_loss`` by name at import time.
_MTP_LOSS_CALLERS = (
    'megatron.core.transformer.multi_token_prediction',
    'megatron.core.models.gpt.gpt_model',
    'megatron.core.models.hybrid.hybrid_model',
)
#: Methods ``dataclasses.dataclass`` generates and only sets when absent from the class dict.
_GENERATED = ('__init__', '__repr__', '__eq__', '__match_args__')


def install() -> None:
    """Give this process's megatron-core the ``'tv'`` and ``'e2e_tv'`` MTP losses.

    Idempotent and thread-safe; may be called before or after models and configs are built
    (configs built earlier read the new fields' class defaults, i.e. ``'ce'``).
    """
    global _installed
    with _lock:
        if _installed:
            return
        from megatron.core.transformer.transformer_config import TransformerConfig

        if _has_fields(TransformerConfig):
            # A tree patched with patches/*.patch: the feature is native there already, and
            # wrapping its process_mtp_loss again would log the metrics twice.
            _installed = True
            return
        add_config_fields(TransformerConfig)
        _install_loss()
        _install_metrics_logging()
        _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def add_config_fields(base: type) -> None:
    """Add the MTP loss fields to dataclass ``base`` and its dataclass subclasses."""
    if _has_fields(base):
        return
    docs = field_docstrings(_config.MTPLossConfig)
    annotations = base.__dict__['__annotations__']  # a dataclass always has its own
    for f in dataclasses.fields(_config.MTPLossConfig):
        annotations[f.name] = f.type
        # Megatron's ArgumentGroupFactory reads help text from the class source, which does not
        # contain these fields: hand it over through the metadata it also honours.
        # (joined into one line, as the factory does with the docstrings it finds itself).
        setattr(base, f.name, dataclasses.field(
            default=f.default, metadata={'argparse_meta': {'help': ' '.join(docs[f.name].split())}}
        ))
    for cls in [base] + _dataclass_subclasses(base):
        _reprocess_dataclass(cls)
    _validate_in_post_init(base)


def _has_fields(cls: type) -> bool:
    return all(f.name in cls.__dataclass_fields__ for f in dataclasses.fields(_config.MTPLossConfig))


def field_docstrings(cls: type) -> Dict[str, str]:
    """The string literal under each annotated field of ``cls`` (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _dataclass_subclasses(base: type) -> List[type]:
    """Dataclass subclasses of ``base``, parents before children."""
    out, stack = [], list(base.__subclasses__())
    while stack:
        cls = stack.pop(0)
        if '__dataclass_fields__' in cls.__dict__ and cls not in out:
            out.append(cls)
        stack.extend(cls.__subclasses__())
    return out


def _reprocess_dataclass(cls: type) -> None:
    """Run ``dataclasses.dataclass`` again on ``cls`` in place, keeping its existing fields."""
    params = cls.__dataclass_params__
    own = cls.__dict__.get('__annotations__', {})
    for name, fld in cls.__dataclass_fields__.items():
        if name in own and not isinstance(cls.__dict__.get(name), dataclasses.Field):
            setattr(cls, name, fld)  # dataclass replaced the Field by its default: restore it
    for name in _GENERATED:
        if name in cls.__dict__:
            delattr(cls, name)
    dataclasses.dataclass(
        cls,
        init=params.init, repr=params.repr, eq=params.eq, order=params.order,
        unsafe_hash=params.unsafe_hash, frozen=params.frozen,
    )


def _validate_in_post_init(base: type) -> None:
    original: Callable = base.__post_init__

    def __post_init__(self):
        original(self)
        _config.validate_mtp_loss_config(self)

    __post_init__.__wrapped__ = original
    __post_init__.__doc__ = original.__doc__
    base.__post_init__ = __post_init__


def _install_loss() -> None:
    from megatron.core.transformer import multi_token_prediction

    dispatcher = _with_tv_losses(multi_token_prediction.process_mtp_loss)
    for name in _MTP_LOSS_CALLERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a model family whose optional dependencies are missing
            continue
        module.process_mtp_loss = dispatcher


def _with_tv_losses(megatron_process_mtp_loss: Callable) -> Callable:
    """Megatron's ``process_mtp_loss`` for ``'ce'``, :func:`process_mtp_tv_loss` otherwise."""
    from .mtp_loss import process_mtp_tv_loss

    @functools.wraps(megatron_process_mtp_loss)
    def process_mtp_loss(*args, **kwargs):
        bound = inspect.signature(megatron_process_mtp_loss).bind(*args, **kwargs).arguments
        config = bound['config']
        if not _config.is_cross_entropy(getattr(config, 'mtp_loss_type', 'ce')):
            return process_mtp_tv_loss(**bound)
        out = megatron_process_mtp_loss(*args, **kwargs)
        if getattr(config, 'mtp_log_acceptance', False) and bound.get('is_training'):
            with torch.no_grad():
                process_mtp_tv_loss(**bound, metrics_only=True)
        return out

    return process_mtp_loss


def _install_metrics_logging() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from .metrics import log_acceptance_metrics

    original = MTPLossLoggingHelper.track_mtp_metrics

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        log_acceptance_metrics(iteration, writer, wandb_writer)
        return original(loss_scale, iteration, writer, wandb_writer, total_loss_dict)

    MTPLossLoggingHelper.track_mtp_metrics = staticmethod(track_mtp_metrics)
