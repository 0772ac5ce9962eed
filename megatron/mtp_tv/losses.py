# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The draft objectives, one class each, and their registry :data:`LOSSES`."""

from typing import ClassVar, Dict, NamedTuple, Optional, Tuple, Type

import torch


class LossTerms(NamedTuple):
    """A chunk's scalar loss, ``[G, n]`` unweighted objective and gradient coefficients."""

    loss: torch.Tensor
    per_depth: torch.Tensor
    tv_coef: Optional[torch.Tensor]
    kl_coef: Optional[torch.Tensor]
    label_coef: Optional[torch.Tensor] = None


class DraftLoss:
    """A draft objective: from per-row sums, its value and logit gradient coefficients in
    ``dL/dz = tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p) + label_coef * (q - e_y)``.

    Attributes:
        per_chain: token weights are ``[s, b]``, one per chain of depths (else ``[G, s, b]``).
        config_fields: ``{constructor argument: TransformerConfig field}``.
        grad_bound: ``c`` with ``max_v |dL/dz_v| <= c * w`` per row.
    """

    name: str = ''
    per_chain: bool = False
    needs_kl: bool = False
    tv_grad: bool = False
    row_local: bool = True
    needs_target: bool = True
    needs_labels: bool = False
    config_fields: ClassVar[Dict[str, str]] = {}
    grad_bound: float = 1.0

    def terms(
        self,
        alpha: Optional[torch.Tensor],
        kl: Optional[torch.Tensor],
        w: torch.Tensor,
        nll: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        """The chunk's terms from ``[G, n]`` overlaps, KL, weights (``[n]`` per chain), NLL."""
        tv_coef, kl_coef = self.row_coefficients(alpha, w)
        per_depth = self.per_token(alpha, kl)
        return LossTerms((w * per_depth).sum(), per_depth, tv_coef, kl_coef)

    def row_coefficients(
        self, alpha: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(tv_coef, kl_coef)``: each row's factor of the TV and KL gradients (None: no
        such term)."""
        raise NotImplementedError

    def per_token(self, alpha: torch.Tensor, kl: Optional[torch.Tensor]) -> torch.Tensor:
        """The objective per token ``[G, n]`` (``[n]`` per chain) from its overlaps and KL."""
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
    """``'e2e_tv'``: ``mean_j (1 - prod_{i<=j} alpha_i)`` per chain (Bebop Eq. 13)."""

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
        # Not 1 - mean_j prod: that cancels to 0 in fp32 when every alpha is within an ulp of 1.
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
    """``'lk'``: ``lambda KL + (1 - lambda)(1 - alpha_k)``, ``lambda = exp(-eta alpha_k)``."""

    name = 'lk'
    needs_kl = True
    tv_grad = True
    config_fields = {'eta': 'mtp_lk_eta'}

    def __init__(self, eta: float = 3.0):
        if isinstance(eta, bool) or not (isinstance(eta, (int, float)) and 0 <= eta < float('inf')):
            raise ValueError(f'it must be a finite number >= 0 (lk eta={eta!r}).')
        self.eta = float(eta)

    def mix(self, alpha: torch.Tensor) -> torch.Tensor:
        """``exp(-eta * alpha)``: the weight of the KL term against the TV term per token."""
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
    """``'nla'``: ``-log(max(alpha_k, NLA_ALPHA_FLOOR))``; its gradient lives below the floor."""

    name = 'nla'
    tv_grad = True

    def row_coefficients(self, alpha, w):
        return w / alpha.clamp(min=NLA_ALPHA_FLOOR), None

    def per_token(self, alpha, kl):
        return -torch.log(alpha.clamp(min=NLA_ALPHA_FLOOR))


class CrossEntropy(DraftLoss):
    """``'ce'`` with ``mtp_ce_chunked``: ``log sum_v exp(z_v) - z_y`` against the labels."""

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
    """The :data:`LOSSES` entry ``loss_type`` built with ``hyperparameters``; else ValueError."""
    if loss_type not in LOSSES:
        raise ValueError(f'loss_type={loss_type!r}; expected one of {list(LOSSES)}.')
    return LOSSES[loss_type](**hyperparameters)


def loss_from_config(config, loss_type: Optional[str] = None) -> DraftLoss:
    """``loss_type`` (default: the config's), hyper-parameters read from the config's fields."""
    loss_type = loss_type or config.mtp_loss_type
    cls = LOSSES.get(loss_type)
    fields = cls.config_fields.items() if cls is not None else ()
    return make_loss(loss_type, **{arg: getattr(config, f) for arg, f in fields})
