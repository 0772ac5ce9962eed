"""The settings of one draft loss, validated once: :class:`MTPLossOptions`."""

from dataclasses import dataclass
from typing import Union

from .config import check_choice, check_setting, is_cross_entropy
from .losses import LOSSES, CrossEntropy, DraftLoss, loss_from_config, make_loss
from .row_ops import ROW_KERNELS, RowKernels

LOSS_NAMES = (CrossEntropy.name,) + tuple(LOSSES)


@dataclass(frozen=True)
class MTPLossOptions:
    """What a call of :func:`~.linear_tv.linear_tv_loss` computes; ValueError for a bad value.

    Args:
        loss: a :class:`~.losses.DraftLoss`, or its name (``'ce'`` or a key of ``LOSSES``).
        chunk_size: tokens per chunk (0: automatic).
        temperature: the verification temperature (1 for a loss against the labels).
        kernels: the row kernels, ``'auto'``, ``'torch'`` or ``'triton'``.
        metrics: also compute the greedy agreement of draft and target argmax.
    """

    loss: Union[DraftLoss, str]
    chunk_size: int = 0
    temperature: float = 1.0
    kernels: RowKernels = 'auto'
    metrics: bool = False

    def __post_init__(self):
        loss = self.loss
        if isinstance(loss, str) and loss in LOSS_NAMES:
            loss = CrossEntropy() if loss == CrossEntropy.name else make_loss(loss)
            object.__setattr__(self, 'loss', loss)
        elif not isinstance(loss, DraftLoss):
            raise ValueError(f"loss={loss!r}; expected a DraftLoss or one of {list(LOSS_NAMES)}.")
        check_setting('chunk_size', self.chunk_size, 'chunk')
        check_setting('temperature', self.temperature, 'temperature')
        object.__setattr__(self, 'temperature', float(self.temperature))
        if loss.needs_labels and self.temperature != 1.0:
            raise ValueError(
                f"temperature={self.temperature!r}: the {loss.name!r} loss is at temperature 1."
            )
        check_choice('kernels', self.kernels, ROW_KERNELS)
        check_setting('metrics', self.metrics, 'flag')

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature

    @property
    def with_target(self) -> bool:
        """Whether the loss or the metrics compare with the main model's distribution."""
        return self.loss.needs_target or self.metrics

    @classmethod
    def from_config(cls, config, metrics: bool, metrics_only: bool = False) -> 'MTPLossOptions':
        """The options of a validated config's MTP loss in this pass (training: ``metrics``)."""
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
    """The config's loss; for ``'ce'``: cross-entropy if chunked, else ``'tv'`` (metrics pass)."""
    if not is_cross_entropy(config.mtp_loss_type):
        return loss_from_config(config)
    if getattr(config, 'mtp_ce_chunked', False) and not metrics_only:
        return CrossEntropy()
    return loss_from_config(config, 'tv')
