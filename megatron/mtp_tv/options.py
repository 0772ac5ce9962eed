"""The settings of one draft loss, built and validated once: :class:`MTPLossOptions`.

:func:`~.linear_tv.linear_tv_loss` takes the tensors and process groups of a call and one
:class:`MTPLossOptions` for what it computes: the objective, the chunk, the verification
temperature, the row kernels and whether to compare the draft and target argmax. The options
check their values when they are built, so nothing downstream checks them again.
:meth:`MTPLossOptions.from_config` builds them from a ``TransformerConfig``'s MTP loss fields.

No Megatron imports.
"""

import math
from dataclasses import dataclass
from typing import Union

from .config import is_cross_entropy
from .losses import LOSSES, CrossEntropy, DraftLoss, loss_from_config, make_loss
from .row_ops import ROW_KERNELS, RowKernels

#: Loss names :class:`MTPLossOptions` accepts: cross-entropy against the labels, then the registry.
LOSS_NAMES = (CrossEntropy.name,) + tuple(LOSSES)


@dataclass(frozen=True)
class MTPLossOptions:
    """What a draft loss computes, fixed for a call of :func:`~.linear_tv.linear_tv_loss`.

    Args:
        loss: the objective, or the name of one (see :attr:`loss`).
        chunk_size: tokens per chunk, 0 for automatic.
        temperature: the verification temperature.
        kernels: the row kernels.
        metrics: also compute the greedy agreement of draft and target argmax.

    Raises:
        ValueError: for a bad value, naming it and what is allowed.
    """

    loss: Union[DraftLoss, str]
    """The objective: a :class:`~.losses.DraftLoss`, or the name of one, built with its default
    hyper-parameters: ``'ce'`` (:class:`~.losses.CrossEntropy`, against the labels) or a key of
    :data:`~.losses.LOSSES`. Always a :class:`~.losses.DraftLoss` once built."""

    chunk_size: int = 0
    """Tokens per chunk, an int >= 0; 0: :func:`~.linear_tv.auto_chunk_tokens`. A chunk covers
    ``max(1, chunk_size // b)`` sequence positions of a micro-batch of ``b`` sequences."""

    temperature: float = 1.0
    """The temperature drafts are verified at, finite and > 0: ``p`` and ``q`` are
    ``softmax(logits / T)``. 1 for a loss against the labels (cross-entropy is at temperature 1).
    Stored as a float."""

    kernels: RowKernels = 'auto'
    """The row kernels: ``'auto'`` (Triton on CUDA fp32 logits, else torch), ``'torch'`` or
    ``'triton'`` (required; :func:`~.row_ops.select_row_ops`)."""

    metrics: bool = False
    """Also compute the greedy agreement of draft and target argmax (the greedy verifier's
    acceptance); needs a target."""

    def __post_init__(self):
        loss = self.loss
        if isinstance(loss, str) and loss in LOSS_NAMES:
            loss = CrossEntropy() if loss == CrossEntropy.name else make_loss(loss)
            object.__setattr__(self, 'loss', loss)
        elif not isinstance(loss, DraftLoss):
            raise ValueError(f"loss={loss!r}; expected a DraftLoss or one of {list(LOSS_NAMES)}.")
        chunk = self.chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"chunk_size={chunk!r} must be an int >= 0 (0: automatic).")
        temperature = self.temperature
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not math.isfinite(temperature) or temperature <= 0):
            raise ValueError(f"temperature={temperature!r} must be a finite number > 0.")
        object.__setattr__(self, 'temperature', float(temperature))
        if loss.needs_labels and self.temperature != 1.0:
            raise ValueError(
                f"temperature={temperature!r}: the {loss.name!r} loss is at temperature 1."
            )
        if self.kernels not in ROW_KERNELS:
            raise ValueError(f"kernels={self.kernels!r}; expected one of {list(ROW_KERNELS)}.")
        if not isinstance(self.metrics, bool):
            raise ValueError(f"metrics={self.metrics!r} must be True or False.")

    @property
    def inv_temperature(self) -> float:
        """``1 / temperature``, what the logits are multiplied by."""
        return 1.0 / self.temperature

    @property
    def with_target(self) -> bool:
        """Whether the loss compares with the main model's distribution: every loss but
        cross-entropy against the labels, and that one too for the metrics."""
        return self.loss.needs_target or self.metrics

    @classmethod
    def from_config(cls, config, metrics: bool, metrics_only: bool = False) -> 'MTPLossOptions':
        """The options of a ``TransformerConfig``'s MTP loss (its fields already validated,
        :func:`~.config.validate_mtp_loss_config`).

        Args:
            config: a ``TransformerConfig`` with the fields of :class:`~.config.MTPLossConfig`.
            metrics: this pass logs the acceptance metrics (training). The greedy agreement is
                then computed where the loss has a target to compare with: always but for
                cross-entropy against the labels (``mtp_ce_chunked``), which has one only with
                ``mtp_log_acceptance``.
            metrics_only: the metrics-only pass of Megatron's own ``'ce'``
                (``mtp_log_acceptance``): the sums of ``'tv'``, no loss attached.
        """
        loss = draft_objective(config, metrics_only)
        return cls(
            loss,
            chunk_size=config.mtp_tv_chunk,
            temperature=getattr(config, 'mtp_tv_temperature', 1.0),
            kernels=getattr(config, 'mtp_tv_kernels', 'auto'),
            metrics=bool(metrics) and (
                loss.needs_target or bool(getattr(config, 'mtp_log_acceptance', False))
            ),
        )


def draft_objective(config, metrics_only: bool = False) -> DraftLoss:
    """The loss a ``TransformerConfig``'s MTP loss computes in the sweep: the config's,
    cross-entropy for ``'ce'`` with ``mtp_ce_chunked``, or ``'tv'``'s sums for the metrics-only
    pass of Megatron's ``'ce'`` (``mtp_log_acceptance``)."""
    if not is_cross_entropy(config.mtp_loss_type):
        return loss_from_config(config)
    if getattr(config, 'mtp_ce_chunked', False) and not metrics_only:
        return CrossEntropy()
    return loss_from_config(config, 'tv')
