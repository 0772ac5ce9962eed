"""Independent references written from the equations: full vocabulary, unchunked, one process.

Nothing here imports the package under test. The equations of docs/losses.md, with p and q the
softmax of the logits divided by the temperature T:
alpha = sum_v min(p, q); per-depth loss 1 - alpha; end-to-end loss
1 - (1/G) sum_j prod_{i<=j} alpha_i; KL(p || q) = sum_v p (log p - log q); LK
lambda KL + (1 - lambda)(1 - alpha) with lambda = exp(-eta alpha) held constant; NLA
-log(max(alpha, 1e-5)) with d/dalpha = -1/max(alpha, 1e-5) everywhere (the gradient is kept alive
below the floor); p detached; at ties the minimum takes p (strict q < p).
"""

import math
from typing import List, Optional, Sequence

import torch


def tv_min(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(p, q) whose gradient w.r.t. q is exactly 1[q < p] (the project's tie convention)."""
    return torch.where(q < p, q, p)


def shifted_mask(mask: torch.Tensor, shift: int, seq_bounds: Optional[Sequence[int]] = None):
    """``out[:, t] = mask[:, t + shift]`` when ``t + shift`` stays inside t's sequence, else 0.

    Args:
        mask: ``[b, s]``. seq_bounds: cumulative sequence lengths of packed sequences.
    """
    b, s = mask.shape
    bounds = list(seq_bounds) if seq_bounds is not None else [0, s]
    out = torch.zeros_like(mask)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for t in range(lo, hi):
            if t + shift < hi:
                out[:, t] = mask[:, t + shift]
    return out


def depth_terms(
    main_hidden, depth_hidden: List[torch.Tensor], weight, seq_bounds=None, logits_fn=None,
    temperature: float = 1.0, main_logits=None,
):
    """``(alpha, kl)``, each ``[G, s, b]``: for every depth k, p from main_hidden at t+k+1
    (detached), q from depth k, both ``softmax(logits / T)`` in float64.

    ``main_logits`` (``[s, b, V]``, any dtype): the main model's logits as it output them (e.g.
    bf16); p is then their softmax, the distribution the main loss sees, and main_hidden is
    unused.

    Positions whose target lies outside their sequence are compared with a uniform p (they are
    masked anyway). Shapes: main_hidden ``[s, b, h]``, depth_hidden[k] ``[s, b, h]``, weight
    ``[V, h]``. Differentiable w.r.t. depth_hidden and weight.
    """
    fn = logits_fn or (lambda z: z)
    main_z = main_logits if main_logits is not None else main_hidden @ weight.t()
    s, b, _ = main_z.shape
    log_p_all = torch.log_softmax(fn(main_z.double()) / temperature, dim=-1).detach()
    bounds = list(seq_bounds) if seq_bounds is not None else [0, s]
    device = main_z.device  # a CUDA run (gpu_check's precision phase) indexes on the device
    seq_end = torch.empty(s, dtype=torch.long)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq_end[lo:hi] = hi
    seq_end = seq_end.to(device)
    uniform = torch.full_like(log_p_all[0, 0], -math.log(log_p_all.shape[-1]))
    positions = torch.arange(s, device=device)
    alphas, kls = [], []
    for k, hidden in enumerate(depth_hidden):
        log_q = torch.log_softmax(fn((hidden @ weight.t()).double()) / temperature, dim=-1)
        target = positions + k + 1
        inside = (target < seq_end).view(s, 1, 1)
        log_p = torch.where(inside, log_p_all[target.clamp(max=s - 1)], uniform)
        p, q = log_p.exp(), log_q.exp()
        alphas.append(tv_min(p, q).sum(-1))
        kls.append((p * (log_p - log_q)).sum(-1))
    return torch.stack(alphas), torch.stack(kls)


def depth_alphas(main_hidden, depth_hidden: List[torch.Tensor], weight, seq_bounds=None, logits_fn=None,
                 temperature: float = 1.0):
    """``alpha[k][t, b]`` of :func:`depth_terms` (``[G, s, b]``)."""
    return depth_terms(main_hidden, depth_hidden, weight, seq_bounds, logits_fn, temperature)[0]


def per_depth_objective(values, masks, scale):
    """``(scale/G) * sum_k sum(mask_k * values_k) / n_k`` (values, masks: ``[G, s, b]``)."""
    G = values.shape[0]
    total = 0.0
    for k in range(G):
        n = masks[k].sum().clamp(min=1)
        total = total + (masks[k] * values[k]).sum() / n
    return scale / G * total


def lk_values(alpha, kl, eta):
    """Per-token LK objective ``lambda kl + (1 - lambda)(1 - alpha)``, ``lambda = exp(-eta alpha)``
    with no gradient through lambda."""
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


#: The documented floor of alpha inside NLA's logarithm.
NLA_FLOOR = 1e-5


def nla_values(alpha, floor=NLA_FLOOR):
    """Per-token ``-log(max(alpha, floor))`` whose derivative is ``-1 / max(alpha, floor)``
    everywhere: above the floor that is the derivative of ``-log(alpha)``; below it the value is
    constant and the derivative is the one at the floor (not a clamp's 0)."""
    kept = alpha.detach().clamp(min=floor)
    return -torch.log(kept) - (alpha - alpha.detach()) / kept


#: The losses written here from their equations (tests/test_registry.py: the package's registry).
LOSS_TYPES = ('tv', 'e2e_tv', 'kl', 'lk', 'nla')


def per_token_values(loss_type, alpha, kl, eta=3.0):
    """The per-token objective each depth logs as ``mtp_{k} loss`` (``1 - alpha`` for the TV losses)."""
    if loss_type in ('tv', 'e2e_tv'):
        return 1 - alpha
    if loss_type == 'nla':
        return nla_values(alpha)
    return kl if loss_type == 'kl' else lk_values(alpha, kl, eta)


def objective(loss_type, alpha, kl, masks, scale, eta=3.0):
    """The Megatron-normalised objective of ``loss_type`` from per-token alpha and kl."""
    if loss_type == 'e2e_tv':
        return e2e_objective(alpha, masks, scale)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f'no reference for loss_type={loss_type!r}')
    return per_depth_objective(per_token_values(loss_type, alpha, kl, eta), masks, scale)


def tv_objective(alpha, masks, scale):
    """Megatron-normalised per-depth TV: ``(scale/G) * sum_k sum(mask_k (1 - alpha_k)) / n_k``.

    alpha, masks: ``[G, s, b]``.
    """
    G = alpha.shape[0]
    total = 0.0
    for k in range(G):
        n = masks[k].sum().clamp(min=1)
        total = total + (masks[k] * (1 - alpha[k])).sum() / n
    return scale / G * total


def e2e_objective(alpha, masks, scale):
    """Eq. 13 per position over valid chains (every depth's mask set), averaged, times scale."""
    G = alpha.shape[0]
    chains = masks.prod(0)
    accepted = torch.zeros_like(alpha[0])
    for j in range(G):
        prod = torch.ones_like(alpha[0])
        for i in range(j + 1):
            prod = prod * alpha[i]
        accepted = accepted + prod
    per_position = 1 - accepted / G
    return scale * (chains * per_position).sum() / chains.sum().clamp(min=1)


def token_weights(loss_type: str, masks: torch.Tensor, scale: float = 0.3) -> torch.Tensor:
    """The ``token_weights`` argument that makes ``linear_tv_loss`` equal :func:`objective` with
    ``masks`` and ``scale``: ``[G, s, b]`` per depth (``'tv'``, ``'kl'``, ``'lk'``, ``'nla'``), ``[s, b]``
    (one weight per valid chain) for ``'e2e_tv'``."""
    G = masks.shape[0]
    if loss_type != 'e2e_tv':
        return masks * (scale / G / masks.sum(dim=(1, 2)).clamp(min=1)).view(-1, 1, 1)
    chains = masks.prod(0)
    return chains * scale / chains.sum().clamp(min=1)
