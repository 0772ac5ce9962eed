"""Independent references written from the equations: full vocabulary, unchunked, one process.

Nothing here imports the package under test. DESIGN.md section 1:
alpha = sum_v min(p, q); per-depth loss 1 - alpha; end-to-end loss
1 - (1/G) sum_j prod_{i<=j} alpha_i; p detached; at ties the minimum takes p (strict q < p).
"""

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


def depth_alphas(main_hidden, depth_hidden: List[torch.Tensor], weight, seq_bounds=None, logits_fn=None):
    """``alpha[k][t, b]`` for every depth k: p from main_hidden at t+k+1 (detached), q from depth k.

    Positions whose target lies outside their sequence get alpha computed against a uniform p
    (they are masked anyway). Shapes: main_hidden ``[s, b, h]``, depth_hidden[k] ``[s, b, h]``,
    weight ``[V, h]``. Returns ``[G, s, b]`` (differentiable w.r.t. depth_hidden and weight).
    """
    fn = logits_fn or (lambda z: z)
    s, b, _ = main_hidden.shape
    p_all = torch.softmax(fn((main_hidden @ weight.t()).double()), dim=-1).detach()
    bounds = list(seq_bounds) if seq_bounds is not None else [0, s]
    seq_end = torch.empty(s, dtype=torch.long)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq_end[lo:hi] = hi
    uniform = torch.full_like(p_all[0, 0], 1.0 / p_all.shape[-1])
    alphas = []
    for k, hidden in enumerate(depth_hidden):
        q = torch.softmax(fn((hidden @ weight.t()).double()), dim=-1)
        rows = []
        for t in range(s):
            target = t + k + 1
            p = p_all[target] if target < seq_end[t] else uniform.expand(b, -1)
            rows.append(tv_min(p, q[t]).sum(-1))
        alphas.append(torch.stack(rows))
    return torch.stack(alphas)


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
    """The ``token_weights`` argument that makes ``linear_tv_loss`` equal :func:`tv_objective` /
    :func:`e2e_objective` with ``masks`` and ``scale``: ``[G, s, b]`` for ``'tv'``, ``[s, b]``
    (one weight per valid chain) for ``'e2e_tv'``."""
    G = masks.shape[0]
    if loss_type == 'tv':
        return masks * (scale / G / masks.sum(dim=(1, 2)).clamp(min=1)).view(-1, 1, 1)
    chains = masks.prod(0)
    return chains * scale / chains.sum().clamp(min=1)
