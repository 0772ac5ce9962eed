"""The TV losses' target from the main head's own logits (Megatron glue).

``GPTModel._postprocess`` runs the MTP loss (``process_mtp_loss``) and then projects the main
head (``self.output_layer(hidden_states, ...)``) for the main loss or, without labels, for the
returned logits. Those logits are exactly the target distribution every TV-family depth needs,
so projecting the main hidden states once more inside the MTP loss would be pure redundancy.

A :class:`MainLogitsTarget` carries them from the one call to the other, as an argument:

1. ``_postprocess`` makes one (:meth:`MainLogitsTarget.for_postprocess`; None where no main
   logits follow) and passes it to ``process_mtp_loss(..., main_logits_target=...)``;
2. the TV loss prepares everything it can (rolled labels and masks, weights, context-parallel
   halos) and, instead of projecting the target itself, :meth:`~MainLogitsTarget.defer`\\ s its
   sweep to the target;
3. the logits the output layer returns go through :meth:`~MainLogitsTarget.attach`, which runs
   the sweep on them (detached: they are the target) and attaches the MTP loss to them
   (:class:`AttachMTPLoss`; ``MTPLossAutoScaler`` is the same trigger for hidden states).

Patch mode writes these calls into ``_postprocess``; plugin mode makes them from outside, with a
wrapper of ``_postprocess`` and a forward hook on its output layer (:mod:`megatron.mtp_tv.plugin`).
The main head is projected once; the main logits, the main loss and their gradients are
Megatron's own, bit for bit.

Where no main logits follow, there is no target and the loss projects its own: a ``_postprocess``
given an ``output_processor`` (it may never call the output layer), Megatron ``dev``'s fused linear
cross-entropy (no logits are materialised), inference (``process_mtp_loss`` is not called there)
and models other than ``GPTModel`` (``HybridModel`` computes its MTP loss in ``forward``).

Imports only torch at module level: ``gpt_model.py`` imports this module in patch mode.
"""

from typing import Callable, Optional

import torch


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


class MainLogitsTarget:
    """The main logits of one ``GPTModel._postprocess`` call, as the target of its MTP loss."""

    def __init__(self):
        self.main_hidden: Optional[torch.Tensor] = None
        """The main hidden states ``[s, b, h]`` the deferred loss expects projected."""
        self._sweep: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.consumed = False

    @classmethod
    def for_postprocess(cls, model, output_processor=None) -> Optional['MainLogitsTarget']:
        """A target for this ``_postprocess`` call of ``model``, or None where no main logits
        follow its MTP loss (see the module docstring)."""
        config = getattr(model, 'config', None)
        if not getattr(config, 'mtp_num_layers', None) or not getattr(model, 'post_process', False):
            return None
        if getattr(model, 'output_layer', None) is None or output_processor is not None:
            return None
        if getattr(model, 'fuse_linear_cross_entropy', False):  # dev: no logits are materialised
            return None
        return cls()

    @property
    def pending(self) -> bool:
        """Whether a loss is deferred to logits not projected yet."""
        return self._sweep is not None

    def defer(self, main_hidden: torch.Tensor, sweep: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Run ``sweep(main_logits)`` (-> the MTP loss) at :meth:`attach`."""
        if self._sweep is not None or self.consumed:
            raise RuntimeError('an MTP loss was already deferred to these main logits')
        self.main_hidden, self._sweep = main_hidden, sweep

    def attach(self, logits: torch.Tensor) -> torch.Tensor:
        """The main logits ``[s, b, V/tp]`` (or gathered) with the deferred MTP loss attached.

        Returns ``logits`` unchanged where nothing was deferred.

        Raises:
            RuntimeError: the main head is projected a second time after the loss was attached
                to the first projection (whose logits may not reach the main loss).
        """
        if self.consumed:
            raise RuntimeError(
                'mtp_tv: GPTModel._postprocess projected the main hidden states twice; the MTP '
                'loss was attached to the first projection, which may not reach the main loss. '
                'This _postprocess is not one mtp_tv knows: report the Megatron version.'
            )
        if self._sweep is None:
            return logits
        sweep, self._sweep, self.consumed = self._sweep, None, True
        loss = sweep(logits.detach())
        if torch.is_grad_enabled() and loss.requires_grad:
            logits = AttachMTPLoss.apply(logits, loss)
        return logits

    def check(self) -> None:
        """Raise if a loss is still deferred (its ``_postprocess`` returned without projecting)."""
        if self.pending:
            raise RuntimeError(
                'mtp_tv: the MTP loss was deferred to the main logits of GPTModel._postprocess, '
                'but its output layer never projected the main hidden states, so the MTP loss '
                'was not computed. This _postprocess is not one mtp_tv knows: report the '
                'Megatron version.'
            )
