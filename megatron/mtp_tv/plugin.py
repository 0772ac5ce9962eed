# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Install the TV losses into a running megatron-core (plugin mode).

:func:`install` does five things, each idempotent:

1. adds the fields of :class:`~megatron.mtp_tv.fields.MTPLossConfig` to ``TransformerConfig`` and
   every already-imported dataclass subclass (re-running ``dataclasses.dataclass`` on them, so
   ``__init__``, ``fields()`` and hence Megatron's ``ArgumentGroupFactory`` and
   ``core_transformer_config_from_args`` see them), and validates them in ``__post_init__``;
2. replaces ``process_mtp_loss`` in the modules that call it (``multi_token_prediction``,
   ``gpt_model``, ``hybrid_model`` import it by name) with a dispatcher that keeps Megatron's
   function for ``'ce'``, and adds :func:`mtp_loss_inputs` to ``multi_token_prediction`` (what a
   patched tree defines there, in its own ``roll_tensor`` and tracker forms);
3. makes ``MTPLossLoggingHelper.track_mtp_metrics`` log the acceptance metrics as well;
4. wraps ``GPTModel._postprocess`` so that the TV losses take their target from the main logits
   it computes anyway, as the patched ``_postprocess`` does in its own code: where
   :func:`~megatron.mtp_tv.mtp_loss.mtp_loss_follows_main_logits`, the dispatcher of 2. only
   splits the hidden states (:class:`_MainLogitsLoss`, handed over in a context variable), and a
   forward hook on the output layer computes the loss on the main logits and attaches it;
5. carries the MTP loss fields Megatron's parsed arguments ask for onto a Megatron-Bridge
   provider in ``TransformerConfig.__post_init__`` (a provider runs it in ``finalize()``) and
   when a ``MultiTokenPredictionBlock`` is built, where it also checks that any config holds them
   (:mod:`~megatron.mtp_tv.training_args`; a patched tree does both in ``get_model``).

Patch mode (``patches/``) makes the same changes in the source of a Megatron tree instead. The
context variable, the hooks and the read of ``megatron.training``'s globals live here, for plugin
mode only.
"""

import contextvars
import dataclasses
import functools
import importlib
import inspect
import sys
import threading
from typing import Callable, Dict, List

from . import config as _config
from .fields import MTPLossConfig, field_docstrings

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

# What this package knows of the Megatron code it calls. ``install()`` checks the running
# megatron-core against these before changing anything, and ``tools/make_patches.py`` checks a
# tree against them (it reads these literals from this file), so that an unknown tree is
# refused with the fact that differs instead of failing at the first forward or, worse,
# computing a wrong loss. Update them together with the code that handles a new form.

#: ``process_mtp_loss`` parameters the MTP losses know (:func:`mtp_loss_inputs` takes all but the
#: hidden states), and those every known tree has.
PROCESS_MTP_LOSS_PARAMS = (
    'hidden_states',
    'labels',
    'loss_mask',
    'output_layer',
    'output_weight',
    'runtime_gather_output',
    'is_training',
    'compute_language_model_loss',
    'config',
    'cp_group',
    'tp_group',
    'packed_seq_params',
    'scale_logits_fn',
    'input_ids',
    'sequence_roll_context',
)
REQUIRED_PROCESS_MTP_LOSS_PARAMS = PROCESS_MTP_LOSS_PARAMS[:9]

#: ``roll_tensor`` forms that :func:`_roll_once` calls correctly, by first parameter:
#: ``(required parameters, optional parameters)``. ``'tensor'``: one tensor in, ``(rolled, sum)``
#: out (megatron-core 0.19, NVIDIA main with ``return_sum``); ``'tensors'``: a list in, a list out
#: (NVIDIA dev, radixark miles-main-20260819).
ROLL_TENSOR_FORMS = {
    'tensor': (('tensor', 'shifts', 'dims', 'cp_group', 'packed_seq_params'), ('return_sum',)),
    'tensors': (
        ('tensors', 'shifts', 'dims', 'cp_group', 'packed_seq_params', 'sequence_fields'),
        ('fill_values', 'roll_context', 'roll_depth'),
    ),
}

#: The ``MTPLossLoggingHelper`` method :func:`_record_depth_metrics` records the
#: per-depth loss with (the first one the tree has), and the parameters it must have.
TRACKER_APIS = {
    'save_metrics_to_tracker': (
        'loss',
        'correct',
        'total',
        'layer_number',
        'num_layers',
        'reduce_group',
        'avg_group',
    ),
    'save_loss_to_tracker': ('loss', 'layer_number', 'num_layers', 'reduce_group', 'avg_group'),
}


class _MainLogitsLoss:
    """The MTP loss of one ``GPTModel._postprocess`` call, between the split of its hidden states
    and the projection of the main head: what the patched ``_postprocess`` keeps in locals."""

    def __init__(self):
        self.main_hidden = self.draft_hidden = None
        self.kwargs: Dict = {}
        self.attached = False

    def split(self, hidden_states, **kwargs):
        """The main hidden states, the MTP loss left for the logits projected from them."""
        from .mtp_loss import split_mtp_hidden_states

        self.main_hidden, self.draft_hidden = split_mtp_hidden_states(
            hidden_states, kwargs['config']
        )
        self.kwargs = kwargs
        return self.main_hidden

    def attach(self, logits):
        """The main logits with the MTP loss attached (:func:`~.mtp_loss.attach_mtp_tv_loss`)."""
        from .mtp_loss import attach_mtp_tv_loss

        if self.attached:
            raise RuntimeError(
                'mtp_tv: GPTModel._postprocess projected the main hidden states twice; the MTP '
                'loss was attached to the first projection, which may not reach the main loss. '
                'This _postprocess is not one mtp_tv knows: report the Megatron version.'
            )
        self.attached = True
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        inputs = mtp_loss_inputs(**self.kwargs)
        return attach_mtp_tv_loss(
            logits, self.main_hidden, self.draft_hidden, inputs, MTPLossAutoScaler
        )

    def check(self) -> None:
        """Raise if the hidden states were split and the main head never projected from them."""
        if self.main_hidden is not None and not self.attached:
            raise RuntimeError(
                'mtp_tv: the MTP loss waited for the main logits of GPTModel._postprocess, but '
                'its output layer never projected the main hidden states, so the MTP loss was '
                'not computed. This _postprocess is not one mtp_tv knows: report the Megatron '
                'version.'
            )


#: The :class:`_MainLogitsLoss` of the running ``GPTModel._postprocess`` (None outside one, or
#: where the loss does not follow the main logits): how the wrapper hands it to the dispatcher.
_MAIN_LOGITS_LOSS: contextvars.ContextVar = contextvars.ContextVar(
    'mtp_tv_main_logits_loss', default=None
)


class UnsupportedMegatronError(RuntimeError):
    """The running megatron-core has MTP code this package does not know how to drive."""


def roll_tensor_problem(params) -> str:
    """Why ``roll_tensor(*params)`` is not a form :func:`_roll_once` knows ('' when it is)."""
    params = tuple(params)
    form = ROLL_TENSOR_FORMS.get(params[0] if params else None)
    if form is None:
        return (
            f"roll_tensor's first parameter is {params[0] if params else None!r}; known forms "
            f'start with {sorted(ROLL_TENSOR_FORMS)}'
        )
    required, optional = form
    missing = [p for p in required if p not in params]
    unknown = [p for p in params if p not in required + optional]
    if missing or unknown:
        return (
            f'roll_tensor{params}: '
            + '; '.join(
                ([f'lacks {missing}'] if missing else [])
                + ([f'has unknown parameter(s) {unknown}'] if unknown else [])
            )
            + f' (the {params[0]!r} form takes {required} and optionally {optional})'
        )
    return ''


def tracker_problem(methods: Dict[str, tuple]) -> str:
    """Why ``MTPLossLoggingHelper`` with ``{method: parameters}`` is unknown ('' when known)."""
    for name, expected in TRACKER_APIS.items():
        if name in methods:
            if tuple(methods[name]) != expected:
                return (
                    f'MTPLossLoggingHelper.{name}{tuple(methods[name])} is not the known '
                    f'{name}{expected}'
                )
            return ''
    return f'MTPLossLoggingHelper has none of {list(TRACKER_APIS)}'


def process_mtp_loss_problem(params, tv_params, tv_required) -> str:
    """Why ``process_mtp_loss(*params)`` cannot be handed to :func:`mtp_loss_inputs`."""
    unknown = [p for p in params if p not in tv_params]
    missing = [p for p in tv_required if p not in params]
    if unknown:
        return (
            f'process_mtp_loss has parameter(s) {unknown} that the TV losses do not know '
            f'(known: {list(tv_params)})'
        )
    if missing:
        return f'process_mtp_loss lacks {missing}, which the TV losses need'
    return ''


def install() -> None:
    """Give this process's megatron-core every MTP loss of the registry (``mtp_loss_type``).

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
        check_megatron()  # before changing anything: an unknown tree is left as it was
        add_config_fields(TransformerConfig)
        _install_loss()
        _install_metrics_logging()
        _install_main_logits()
        _install_args_check()
        _installed = True


def check_megatron() -> None:
    """Raise :class:`UnsupportedMegatronError` if this megatron-core's MTP code is unknown.

    Checked: the parameters of ``process_mtp_loss`` (every one must be in
    :data:`PROCESS_MTP_LOSS_PARAMS`), the form of ``roll_tensor`` (see
    :data:`ROLL_TENSOR_FORMS`) and the tracker method the acceptance metrics use
    (:data:`TRACKER_APIS`).
    """
    from megatron.core.transformer import multi_token_prediction as mtp

    helper = mtp.MTPLossLoggingHelper
    problems = [
        (
            process_mtp_loss_problem(
                _params(mtp.process_mtp_loss),
                PROCESS_MTP_LOSS_PARAMS,
                REQUIRED_PROCESS_MTP_LOSS_PARAMS,
            )
            if hasattr(mtp, 'process_mtp_loss')
            else 'no process_mtp_loss (a tree whose MTP loss is inline in GPTModel._postprocess, '
            'like radixark miles-main, needs a patch from patches/)'
        ),
        (
            roll_tensor_problem(_params(mtp.roll_tensor))
            if hasattr(mtp, 'roll_tensor')
            else 'no roll_tensor'
        ),
        tracker_problem(
            {name: _params(getattr(helper, name)) for name in TRACKER_APIS if hasattr(helper, name)}
        ),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise UnsupportedMegatronError(
            f'megatron.mtp_tv.install(): the MTP code of this megatron-core ({mtp.__file__}) is '
            f'not what this package knows, so it was left unchanged:\n  '
            + '\n  '.join(problems)
            + "\nUse a supported megatron-core (0.19.x, NVIDIA Megatron-LM main or dev), or "
            'tools/make_patches.py --tree, which names the same facts for a checkout.'
        )


def _megatron_training_args():
    """``megatron.training``'s parsed arguments, or None: read only if something imported its
    global variables module (``get_args()`` asserts while they are unset, and importing
    ``megatron.training`` costs seconds). Read at each call: launchers set and clear them."""
    global_vars = sys.modules.get('megatron.training.global_vars')
    return getattr(global_vars, '_GLOBAL_ARGS', None)


def _params(fn) -> tuple:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def add_config_fields(base: type) -> None:
    """Add the MTP loss fields to dataclass ``base`` and its dataclass subclasses."""
    if _has_fields(base):
        return
    docs = field_docstrings(MTPLossConfig)
    annotations = base.__dict__['__annotations__']  # a dataclass always has its own
    for f in dataclasses.fields(MTPLossConfig):
        annotations[f.name] = f.type
        # Megatron's ArgumentGroupFactory reads help text from the class source, which does not
        # contain these fields: hand it over through the metadata it also honours.
        # (joined into one line, as the factory does with the docstrings it finds itself).
        setattr(
            base,
            f.name,
            dataclasses.field(
                default=f.default,
                metadata={'argparse_meta': {'help': ' '.join(docs[f.name].split())}},
            ),
        )
    for cls in [base] + _dataclass_subclasses(base):
        _reprocess_dataclass(cls)
    _validate_in_post_init(base)


def _has_fields(cls: type) -> bool:
    return all(f.name in cls.__dataclass_fields__ for f in dataclasses.fields(MTPLossConfig))


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
        init=params.init,
        repr=params.repr,
        eq=params.eq,
        order=params.order,
        unsafe_hash=params.unsafe_hash,
        frozen=params.frozen,
    )


def _validate_in_post_init(base: type) -> None:
    from .training_args import carry_to_bridge_provider

    original: Callable = base.__post_init__

    def __post_init__(self):
        original(self)
        # a Megatron-Bridge provider takes the parsed arguments' fields (finalize() runs this)
        carry_to_bridge_provider(self, _megatron_training_args())
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
    # what a patched tree defines next to process_mtp_loss
    multi_token_prediction.mtp_loss_inputs = mtp_loss_inputs


def _with_tv_losses(megatron_process_mtp_loss: Callable) -> Callable:
    """Megatron's ``process_mtp_loss`` that branches on ``mtp_loss_type`` as a patched tree's
    does: every MTP loss but Megatron's own ``'ce'`` (its acceptance metrics logged first with
    ``mtp_log_acceptance``) through :func:`~.mtp_loss.process_mtp_tv_loss`."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from .mtp_loss import process_mtp_tv_loss

    @functools.wraps(megatron_process_mtp_loss)
    def process_mtp_loss(*args, **kwargs):
        bound = inspect.signature(megatron_process_mtp_loss).bind(*args, **kwargs).arguments
        pending = _MAIN_LOGITS_LOSS.get()
        if pending is not None and pending.main_hidden is None:
            return pending.split(**bound)
        config = bound['config']
        megatron_ce = _config.runs_megatron_ce(config)
        if not megatron_ce or (bound['is_training'] and config.mtp_log_acceptance):
            hidden_states = bound.pop('hidden_states')
            main_hidden, loss = process_mtp_tv_loss(hidden_states, mtp_loss_inputs(**bound))
            if not megatron_ce:
                return main_hidden if loss is None else MTPLossAutoScaler.apply(main_hidden, loss)
        return megatron_process_mtp_loss(*args, **kwargs)

    return process_mtp_loss


def mtp_loss_inputs(
    labels,
    loss_mask,
    output_layer,
    output_weight,
    runtime_gather_output,
    is_training,
    compute_language_model_loss,
    config,
    cp_group=None,
    tp_group=None,
    packed_seq_params=None,
    scale_logits_fn=None,
    input_ids=None,
    sequence_roll_context=None,
):
    """``process_mtp_loss``'s arguments (but the hidden states) as the MTP losses take them, with
    this megatron-core's ``roll_tensor`` and MTP tracker: the plugin's form of the function a
    patched tree defines in ``multi_token_prediction.py``. ``runtime_gather_output`` and
    ``compute_language_model_loss`` are unused (the MTP losses build no full logits)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from .mtp_loss import MTPLossInputs

    del runtime_gather_output, compute_language_model_loss
    return MTPLossInputs(
        labels=labels,
        loss_mask=loss_mask,
        output_layer=output_layer,
        output_weight=output_weight,
        is_training=is_training,
        config=config,
        roll=functools.partial(
            _roll_once,
            cp_group=cp_group,
            packed_seq_params=packed_seq_params,
            roll_context=sequence_roll_context,
        ),
        record_depth_metrics=_record_depth_metrics,
        tracker=MTPLossLoggingHelper.tracker,
        cp_group=cp_group,
        tp_group=tp_group,
        packed_seq_params=packed_seq_params,
        scale_logits_fn=scale_logits_fn,
        input_ids=input_ids,
        detach_output_weight=config.mtp_detach_heads,
    )


def _roll_once(tensor, field, depth, cp_group, packed_seq_params, roll_context=None):
    """Megatron's ``roll_tensor(tensor, shifts=-1, dims=-1)`` -> ``(rolled, rolled.sum())``, in
    either form of :data:`ROLL_TENSOR_FORMS` (looked up per call: tests stand in for it)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    if 'sequence_fields' in inspect.signature(mtp.roll_tensor).parameters:  # NVIDIA dev's form
        context = (
            {}
            if roll_context is None
            else dict(roll_context=roll_context, sequence_fields=[field], roll_depth=depth)
        )
        (rolled,) = mtp.roll_tensor(
            [tensor],
            shifts=-1,
            dims=-1,
            cp_group=cp_group,
            packed_seq_params=packed_seq_params,
            **context,
        )
        return rolled, rolled.sum()
    if roll_context is not None:
        raise ValueError(
            f"sequence_roll_context={type(roll_context).__name__} was given, but this Megatron's "
            "roll_tensor takes no roll context (only the list form of NVIDIA dev does)."
        )
    return mtp.roll_tensor(
        tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
    )


def _record_depth_metrics(loss, correct, count, layer_number, num_layers, avg_group) -> None:
    """One depth's ``mtp_{k} loss`` through the tracker method of :data:`TRACKER_APIS` that this
    megatron-core has (``save_loss_to_tracker`` logs no greedy accuracy)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, 'save_metrics_to_tracker'):
        MTPLossLoggingHelper.save_metrics_to_tracker(
            loss, correct, count, layer_number, num_layers, avg_group=avg_group
        )
    else:
        MTPLossLoggingHelper.save_loss_to_tracker(
            loss, layer_number, num_layers, avg_group=avg_group
        )


def _install_metrics_logging() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from .metrics import log_acceptance_metrics

    original = MTPLossLoggingHelper.track_mtp_metrics

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        log_acceptance_metrics(
            MTPLossLoggingHelper.tracker, iteration, writer, wandb_writer, total_loss_dict
        )
        return original(loss_scale, iteration, writer, wandb_writer, total_loss_dict)

    MTPLossLoggingHelper.track_mtp_metrics = staticmethod(track_mtp_metrics)


def _install_main_logits() -> None:
    """What the patched ``_postprocess`` does in its own code, from outside: the MTP loss on the
    logits of the main head's projection."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from . import mtp_loss

    original = GPTModel._postprocess
    if getattr(original, '__mtp_tv_main_logits__', False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _postprocess(self, *args, **kwargs):
        output_processor = signature.bind_partial(self, *args, **kwargs).arguments.get(
            'output_processor'
        )
        if not mtp_loss.mtp_loss_follows_main_logits(self, output_processor):
            return original(self, *args, **kwargs)
        pending = _MainLogitsLoss()
        hook = self.output_layer.register_forward_hook(
            functools.partial(_attach_main_logits, pending), with_kwargs=True
        )
        token = _MAIN_LOGITS_LOSS.set(pending)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _MAIN_LOGITS_LOSS.reset(token)
            hook.remove()
        pending.check()
        return out

    _postprocess.__mtp_tv_main_logits__ = True
    # The class attribute, so that models built before install() get it too.
    GPTModel._postprocess = _postprocess


def _attach_main_logits(pending: _MainLogitsLoss, module, args, kwargs, output):
    """Forward hook of the output layer: the projection of the main hidden states gets the MTP
    loss attached (other projections, e.g. of an MTP depth, pass)."""
    hidden = args[0] if args else kwargs.get('input_', kwargs.get('hidden_states'))
    if pending.main_hidden is None or hidden is not pending.main_hidden:
        return None
    # Megatron's parallel linear layers return (output, bias); a plain module its output.
    if isinstance(output, tuple):
        return (pending.attach(output[0]), *output[1:])
    return pending.attach(output)


def _install_args_check() -> None:
    """Check Megatron's arguments against the config once per model, where its MTP block is built."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from .training_args import carry_to_bridge_provider, check_megatron_args

    original = MultiTokenPredictionBlock.__init__
    if getattr(original, '__mtp_tv_args_check__', False):
        return

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        # before building anything: a wrong config trains nothing (a Megatron-Bridge provider
        # finalized before Megatron's set_args takes the arguments' fields here)
        megatron_args = _megatron_training_args()
        carry_to_bridge_provider(config, megatron_args)
        check_megatron_args(config, megatron_args)
        original(self, config, *args, **kwargs)

    __init__.__mtp_tv_args_check__ = True
    MultiTokenPredictionBlock.__init__ = __init__
