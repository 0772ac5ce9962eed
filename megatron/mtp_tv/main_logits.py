"""The TV losses' target from the main head's own logits (Megatron glue).

``GPTModel._postprocess`` runs the MTP loss (``process_mtp_loss``) and then projects the main
head (``self.output_layer(hidden_states, ...)``) for the main loss or, without labels, for the
returned logits. Those logits are exactly the target distribution every TV-family depth needs,
so projecting the main hidden states once more inside the MTP loss would be pure redundancy.

:func:`reuse_main_logits` decorates ``_postprocess`` (the plugin wraps it at ``install()``, the
patches write the decorator into ``gpt_model.py``). While the decorated call runs, a
:class:`MainLogitsSlot` is open for the model's output layer; ``process_mtp_tv_loss`` then
prepares everything it can (rolled labels and masks, weights, context-parallel halos) and, instead
of projecting the target itself, :meth:`MainLogitsSlot.defer`\\ s its sweep to the output layer's
next forward on the main hidden states it returns. A one-shot forward hook runs the sweep on
that call's logits (detached: they are the target) and attaches the MTP loss to them
(:class:`AttachMTPLoss`, the backward trigger ``MTPLossAutoScaler`` is for the hidden states).
The main head is projected once; the main logits, the main loss and their gradients are
Megatron's own, bit for bit.

Where no main logits follow, nothing is deferred and the loss projects its own target as
before: no slot is opened for a ``_postprocess`` given an ``output_processor`` (it may never
call the output layer), for Megatron ``dev``'s fused linear cross-entropy (no logits are
materialised), in inference (``process_mtp_loss`` is not called there; last-token-only logits
never reach it), for the recompute mode (``mtp_tv_backward='recompute'``, which would keep the
logits for backward while Megatron's cross-entropy overwrites them in place), for models other
than ``GPTModel`` (``HybridModel`` computes its MTP loss in ``forward``) or with
``mtp_tv_target='projection'``. A deferred loss that no output-layer call picked up is an
error raised at the end of the same ``_postprocess``, never a silently missing MTP gradient.

Imports only torch at module level: ``gpt_model.py`` imports this module in patch mode.
"""

import contextvars
import functools
import inspect
from typing import Callable, Optional

import torch

_SLOT: contextvars.ContextVar = contextvars.ContextVar('mtp_tv_main_logits_slot', default=None)


class AttachMTPLoss(torch.autograd.Function):
    """Identity on the main logits whose backward also starts the MTP loss's backward.

    ``MTPLossAutoScaler``'s job (its scale too: ``main_loss_backward_scale``), for logits instead
    of hidden states. The logits are returned as the same tensor, marked dirty, so that
    Megatron's cross-entropy may still work on them in place (as it does on fp32 logits); a
    Function returning its input as a view would forbid that.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, mtp_loss: torch.Tensor):
        ctx.save_for_backward(mtp_loss)
        ctx.mark_dirty(logits)
        return logits

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        (mtp_loss,) = ctx.saved_tensors
        return grad_logits, torch.ones_like(mtp_loss) * MTPLossAutoScaler.main_loss_backward_scale


class MainLogitsSlot:
    """The main logits of one ``_postprocess`` call, handed to the MTP loss deferred to them."""

    def __init__(self, output_layer):
        self.output_layer = output_layer
        self._pending = None  # (main hidden states, sweep: logits -> loss)
        self._handle = None
        self.consumed = False

    def defer(self, main_hidden: torch.Tensor, sweep: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Run ``sweep(main_logits)`` when the output layer projects ``main_hidden`` (this object)."""
        if self._pending is not None:
            raise RuntimeError('an MTP loss was already deferred to this _postprocess call')
        self._pending = (main_hidden, sweep)
        self._handle = self.output_layer.register_forward_hook(self._on_output, with_kwargs=True)

    def _on_output(self, module, args, kwargs, output):
        main_hidden, sweep = self._pending
        hidden = args[0] if args else kwargs.get('input_', kwargs.get('hidden_states'))
        if hidden is not main_hidden:  # another projection (e.g. of an MTP depth): not ours
            return None
        self.close()
        self.consumed = True
        # Megatron's parallel linear layers return (output, bias); a plain module its output.
        logits = output[0] if isinstance(output, tuple) else output
        loss = sweep(logits.detach())
        if torch.is_grad_enabled() and loss.requires_grad:
            logits = AttachMTPLoss.apply(logits, loss)
        return (logits, *output[1:]) if isinstance(output, tuple) else logits

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def check(self) -> None:
        """Raise if a loss was deferred and no output-layer call computed it."""
        if self._pending is not None and not self.consumed:
            raise RuntimeError(
                'mtp_tv: the MTP loss was deferred to the main logits of GPTModel._postprocess, '
                'but its output layer never projected the main hidden states, so the MTP loss '
                "was not computed. This _postprocess is not one mtp_tv knows; set "
                "mtp_tv_target='projection' to project the target inside the MTP loss instead, "
                'and report the Megatron version.'
            )


def open_slot(output_layer) -> Optional[MainLogitsSlot]:
    """The slot of the running decorated ``_postprocess`` for ``output_layer``, if any."""
    slot = _SLOT.get()
    if slot is None or slot.output_layer is not output_layer or slot._pending is not None:
        return None
    return slot


def reuse_main_logits(postprocess: Callable) -> Callable:
    """Decorate ``GPTModel._postprocess`` so that the TV losses read their target from the main
    logits it computes (see the module docstring)."""
    if getattr(postprocess, '__mtp_tv_reuse_main_logits__', False):
        return postprocess
    signature = inspect.signature(postprocess)

    @functools.wraps(postprocess)
    def _postprocess(self, *args, **kwargs):
        slot = None
        if _main_logits_follow(self, signature, args, kwargs):
            slot = MainLogitsSlot(self.output_layer)
        token = _SLOT.set(slot)
        try:
            out = postprocess(self, *args, **kwargs)
        finally:
            _SLOT.reset(token)
            if slot is not None:
                slot.close()
        if slot is not None:
            slot.check()
        return out

    _postprocess.__mtp_tv_reuse_main_logits__ = True
    return _postprocess


def _main_logits_follow(model, signature, args, kwargs) -> bool:
    """Whether this ``_postprocess`` call projects the main head after its MTP loss."""
    config = getattr(model, 'config', None)
    if getattr(config, 'mtp_tv_target', 'main_logits') != 'main_logits':
        return False
    if not getattr(config, 'mtp_num_layers', None) or not getattr(model, 'post_process', False):
        return False
    if getattr(model, 'output_layer', None) is None:
        return False
    if getattr(model, 'fuse_linear_cross_entropy', False):  # dev: no logits are materialised
        return False
    bound = signature.bind_partial(model, *args, **kwargs).arguments
    return bound.get('output_processor') is None
