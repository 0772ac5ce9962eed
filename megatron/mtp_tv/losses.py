"""The acceptance-aware draft objectives, one small class each, plugged into the chunked sweep.

The sweep in :mod:`.linear_tv` projects a chunk's logits, normalises them at the verification
temperature ``T`` and reduces, for every depth-k draft row against its target row, the per-row
sums a loss asks for: the overlap ``alpha = sum_v min(p, q)`` (always: it is the acceptance
metric), the dot product ``sum_v q_v 1[q_v < p_v]`` of the TV gradient, and ``KL(p || q)``.
A :class:`DraftLoss` then says, from those sums and the rows' loss weights ``w`` (mask and
normalisation included), what the chunk's objective is and the two coefficients of its logit
gradient (with respect to the logits divided by ``T``)::

    dL/dz = tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)

since ``d alpha / dz = q * (1[q < p] - dot)`` and ``d KL / dz = q - p``.

Low-precision contract: every loss states :attr:`DraftLoss.grad_bound`, a number ``c`` with
``max_v |dL/dz_v| <= c * w`` for every row, whatever the logits; the sweep scales bf16/fp16 logit
gradients by a power of two chosen from ``c * max(w) / T`` without looking at them. The bound is on
the gradient entries, not on the coefficients: ``|d alpha/dz_v| <= alpha`` and
``|d KL/dz_v| <= 1`` (``dot <= alpha`` since its terms are a subset of alpha's, and ``q_v <= alpha``
wherever ``q_v < p_v``), so ``|tv_coef| * alpha + |kl_coef| <= c * w`` suffices. The TV, KL and
LK losses have ``|tv_coef| + |kl_coef| <= w`` (``c = 1``); ``'nla'``'s ``tv_coef = w / alpha_f``
is unbounded, yet ``tv_coef * alpha <= w`` (``c = 1`` too).

Adding a loss means adding a class here (and, for a hyper-parameter, its ``TransformerConfig``
field in :mod:`.config`, named in :attr:`DraftLoss.config_fields`): the registry :data:`LOSSES`
is the one list of loss names, from which ``mtp_loss_type``'s choices, the demos' arms and the
tests' loss lists derive. The sweep does not change. No Megatron imports.
"""

from typing import ClassVar, Dict, NamedTuple, Optional, Tuple, Type

import torch


class LossTerms(NamedTuple):
    """What a :class:`DraftLoss` makes of one chunk."""

    loss: torch.Tensor
    """Scalar: the chunk's weighted objective."""
    per_depth: torch.Tensor
    """``[G, n]``: each depth's unweighted per-token objective (what ``mtp_{k} loss`` logs)."""
    tv_coef: Optional[torch.Tensor]
    """``[G, n]`` coefficient of the TV gradient term, or None."""
    kl_coef: Optional[torch.Tensor]
    """``[G, n]`` coefficient of the KL gradient term, or None."""
    label_coef: Optional[torch.Tensor] = None
    """``[G, n]`` coefficient of the label gradient term ``q - e_y``, or None."""


class DraftLoss:
    """One draft-head objective over the per-row sums of the sweep.

    Attributes:
        name: the ``mtp_loss_type`` value.
        per_chain: token weights are ``[s, b]``, one per chain of depths (else ``[G, s, b]``).
        needs_kl: the sweep must compute ``KL(p || q)`` per row.
        tv_grad: the gradient has a TV term (the sweep then computes the per-row dot product
            ``sum_v q_v 1[q_v < p_v]`` it needs).
        row_local: a row's coefficients depend on that row alone, so on a single vocabulary
            shard the gradient can be written in the same pass that computes the row's sums.
        needs_target: the objective compares each draft row with a target row of the main
            model (every loss of :data:`LOSSES`); without it the sweep projects no target rows
            unless the acceptance metrics ask for them.
        needs_labels: the objective reads each row's data label (its logit and the row's
            log-normaliser, :class:`CrossEntropy`).
    """

    name: str = ''
    per_chain: bool = False
    needs_kl: bool = False
    tv_grad: bool = False
    row_local: bool = True
    needs_target: bool = True
    needs_labels: bool = False
    config_fields: ClassVar[Dict[str, str]] = {}
    """``{constructor argument: TransformerConfig field}`` of the loss's hyper-parameters."""
    grad_bound: float = 1.0
    """``c`` with ``max_v |dL/dz_v| <= c * w`` per row (dL/dz w.r.t. the logits divided by T); the
    sweep's low-precision gradient scaling relies on it (see the module docstring)."""

    def terms(self, alpha: Optional[torch.Tensor], kl: Optional[torch.Tensor], w: torch.Tensor,
              nll: Optional[torch.Tensor] = None) -> LossTerms:
        """The chunk's objective and gradient coefficients.

        Args:
            alpha: ``[G, n]`` overlaps of the chunk's rows (None without target rows).
            kl: ``[G, n]`` ``KL(p || q)`` per row (when :attr:`needs_kl`), else None.
            w: ``[G, n]`` per-row loss weights (``[n]`` when :attr:`per_chain`).
            nll: ``[G, n]`` ``log sum_v exp(z_v) - z_y`` per row (when :attr:`needs_labels`).
        """
        tv_coef, kl_coef = self.row_coefficients(alpha, w)
        per_depth = self.per_token(alpha, kl)
        return LossTerms((w * per_depth).sum(), per_depth, tv_coef, kl_coef)

    def row_coefficients(
        self, alpha: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(tv_coef, kl_coef)`` of rows from their overlap and weight (row-local losses)."""
        raise NotImplementedError

    def per_token(self, alpha: torch.Tensor, kl: Optional[torch.Tensor]) -> torch.Tensor:
        """The unweighted objective of every row."""
        raise NotImplementedError


class TVLoss(DraftLoss):
    """``'tv'``: ``1 - alpha_k`` per depth (Bebop Eq. 10); ``dL/dz = -w d alpha/dz``."""

    name = 'tv'
    tv_grad = True

    def row_coefficients(self, alpha, w):
        return w, None

    def per_token(self, alpha, kl):
        return 1.0 - alpha


class EndToEndTVLoss(DraftLoss):
    """``'e2e_tv'``: ``mean_j (1 - prod_{i<=j} alpha_i)`` per chain (Bebop Eq. 13).

    ``dL/dalpha_i = -(w/G) prod_{k<i} alpha_k (1 + sum_{j>i} prod_{i<k<=j} alpha_k)``: no division
    by alpha, so alpha = 0 is safe; the coefficient is at most ``w`` (the prefix product is at
    most 1, the suffix sum at most G).
    """

    name = 'e2e_tv'
    per_chain = True
    tv_grad = True
    row_local = False

    def terms(self, alpha, kl, w, nll=None):
        G = alpha.shape[0]
        prefix = torch.cat([torch.ones_like(alpha[:1]), alpha[:-1]]).cumprod(0)  # prod_{k<i}
        suffix = [torch.ones_like(alpha[0])]  # 1 + sum_{j>i} prod_{i<k<=j} alpha_k
        for i in range(G - 1, 0, -1):
            suffix.append(1.0 + alpha[i] * suffix[-1])
        suffix = torch.stack(suffix[::-1])
        # mean_j (1 - prod_{i<=j} alpha_i), not 1 - mean_j prod: the latter cancels to 0 in fp32
        # when every alpha is within an ulp of 1.
        rejected = (1.0 - prefix * alpha).mean(0)
        return LossTerms((w * rejected).sum(), 1.0 - alpha, (w / G) * prefix * suffix, None)


class KLLoss(DraftLoss):
    """``'kl'``: ``KL(p || q_k)`` per depth (self-distillation); ``dL/dz = w (q - p)``."""

    name = 'kl'
    needs_kl = True

    def row_coefficients(self, alpha, w):
        return None, w

    def per_token(self, alpha, kl):
        return kl


class LKLoss(DraftLoss):
    """``'lk'``: ``lambda KL(p || q_k) + (1 - lambda)(1 - alpha_k)``, ``lambda = exp(-eta alpha_k)``
    held constant (the LK losses paper, arXiv 2602.23881): a cold head (alpha near 0) learns like
    KL, a warm one like TV. ``eta = 0`` is ``'kl'``; large ``eta`` approaches ``'tv'``."""

    name = 'lk'
    needs_kl = True
    tv_grad = True
    config_fields = {'eta': 'mtp_lk_eta'}

    def __init__(self, eta: float = 3.0):
        if isinstance(eta, bool) or not (isinstance(eta, (int, float)) and 0 <= eta < float('inf')):
            raise ValueError(f'it must be a finite number >= 0 (lk eta={eta!r}).')
        self.eta = float(eta)

    def mix(self, alpha: torch.Tensor) -> torch.Tensor:
        """``lambda = exp(-eta alpha)`` (no gradient flows through it: alpha is detached)."""
        return torch.exp(-self.eta * alpha)

    def row_coefficients(self, alpha, w):
        lam = self.mix(alpha)
        return w * (1.0 - lam), w * lam

    def per_token(self, alpha, kl):
        lam = self.mix(alpha)
        return lam * kl + (1.0 - lam) * (1.0 - alpha)


#: Floor of alpha inside ``'nla'``'s logarithm (speculators' ``nla`` clamps at the same value).
NLA_ALPHA_FLOOR = 1e-5


class NLALoss(DraftLoss):
    """``'nla'``: ``-log(alpha_f)`` per depth, ``alpha_f = max(alpha_k, NLA_ALPHA_FLOOR)`` (the LK
    losses paper's LK^alpha, arXiv 2602.23881; speculators' ``nla``).

    Optimises acceptance directly like ``'tv'`` and has no hyper-parameter. Gradient: ``dL/dalpha
    = -1/alpha_f`` everywhere, i.e. ``tv_coef = w / alpha_f``; below the floor the value is the
    constant ``-log(1e-5) = 11.51`` but the gradient is kept alive as ``-(w / 1e-5) d alpha/dz``
    (a clamp, as in speculators, would zero it there), so a cold head far below the floor still
    learns. It does not vanish from a cold start: at a one-hot target ``p = e_y``,
    ``alpha = q_y`` and the loss is cross-entropy ``-log q_y`` with its gradient ``q - e_y``
    (above the floor). The coefficient is not bounded by ``w`` but the logit gradient is:
    ``|d alpha/dz_v| <= alpha``, so ``|dL/dz_v| <= w alpha / alpha_f <= w`` (``grad_bound = 1``).
    Finite at alpha = 0 (value 11.51, gradient 0 there since ``d alpha/dz`` vanishes with alpha).
    """

    name = 'nla'
    tv_grad = True

    def row_coefficients(self, alpha, w):
        return w / alpha.clamp(min=NLA_ALPHA_FLOOR), None

    def per_token(self, alpha, kl):
        return -torch.log(alpha.clamp(min=NLA_ALPHA_FLOOR))


class CrossEntropy(DraftLoss):
    """Cross-entropy against the data labels, ``log sum_v exp(z_v) - z_y`` per depth: Megatron's
    own MTP objective computed in the sweep (``mtp_loss_type='ce'`` with ``mtp_ce_chunked``), at
    the memory of a chunk. ``dL/dz = w (q - e_y)``, so ``|dL/dz_v| <= w`` (``grad_bound = 1``).

    Not in :data:`LOSSES`: it is not an ``mtp_loss_type`` of its own but ``'ce'`` computed
    another way. No target rows (unless the acceptance metrics ask for them), no temperature:
    ``z`` are the draft logits as Megatron's cross-entropy sees them.
    """

    name = 'ce'
    needs_target = False
    needs_labels = True
    row_local = False  # its gradient needs no per-row sums: written after the normaliser

    def terms(self, alpha, kl, w, nll=None):
        return LossTerms((w * nll).sum(), nll, None, None, label_coef=w)


#: The registry: every ``mtp_loss_type`` but cross-entropy, in the order the CLI lists them.
LOSSES: Dict[str, Type[DraftLoss]] = {
    cls.name: cls for cls in (TVLoss, EndToEndTVLoss, KLLoss, LKLoss, NLALoss)
}


def make_loss(loss_type: str, **hyperparameters) -> DraftLoss:
    """The :class:`DraftLoss` named ``loss_type`` (a key of :data:`LOSSES`).

    Args:
        loss_type: an ``mtp_loss_type`` other than cross-entropy.
        **hyperparameters: the loss's constructor arguments (e.g. ``eta`` of ``'lk'``); the
            defaults where omitted.
    """
    if loss_type not in LOSSES:
        raise ValueError(f'loss_type={loss_type!r}; expected one of {list(LOSSES)}.')
    return LOSSES[loss_type](**hyperparameters)


def loss_from_config(config, loss_type: Optional[str] = None) -> DraftLoss:
    """The :class:`DraftLoss` of a ``TransformerConfig``: ``loss_type`` (default
    ``config.mtp_loss_type``) with its hyper-parameters read from the fields the class names in
    :attr:`DraftLoss.config_fields` (the class default where the config lacks one)."""
    loss_type = loss_type or config.mtp_loss_type
    cls = LOSSES.get(loss_type)
    fields = cls.config_fields.items() if cls is not None else ()
    return make_loss(
        loss_type, **{arg: getattr(config, f) for arg, f in fields if hasattr(config, f)}
    )
