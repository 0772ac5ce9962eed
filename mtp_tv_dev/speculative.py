"""Speculative sampling: the rejection-sampling verifier that makes ``1 - TV`` the acceptance rate.

A draft model proposes ``gamma`` tokens ``d_1 .. d_gamma`` autoregressively, ``d_i ~ q_i``. The
main model scores the same context once and gives ``p_1 .. p_{gamma+1}`` (``p_i`` is its
distribution for the position of ``d_i``; ``p_{gamma+1}`` follows the last draft). The verifier
(Leviathan et al. 2023, Chen et al. 2023) walks the drafts in order:

* accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
* at the first rejection, emit a token from the residual ``norm(max(p_i - q_i, 0))`` and stop;
* if every draft is accepted, emit a bonus token from ``p_{gamma+1}``.

Each emitted token is then distributed exactly as the main model's ``p`` at its position (the
output of speculative sampling is indistinguishable from sampling the main model), and the
probability of accepting ``d_i`` given that ``d_1 .. d_{i-1}`` were accepted is
``alpha_i = sum_v min(p_i, q_i) = 1 - TV(p_i, q_i)``. So the expected number of accepted drafts per
verify step is ``sum_j prod_{i<=j} alpha_i`` and one more token is always emitted.

Serving at a temperature ``T`` samples both models at ``T``: :func:`probabilities` gives
``softmax(z / T)`` for either side, and the same verifier then accepts with probability
``sum_v min(p_T, q_T)``. Greedy serving (``T = 0``) is :func:`verify_greedy`: each draft is the
draft model's argmax and is accepted iff it is also the main model's argmax, so the output is
exactly the main model's greedy decoding.

Pure torch (no Megatron): everything here is batched over a leading batch dimension ``B`` of
independent verify steps, works on probabilities (there is no top-k/top-p truncation) and draws
all randomness from an optional ``torch.Generator`` so that a seeded run is reproducible.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    'VerifyResult',
    'acceptance_probability',
    'residual_distribution',
    'sample',
    'verify',
    'verify_greedy',
    'probabilities',
    'expected_accepted_drafts',
    'rao_blackwell_accepted',
]


class VerifyResult(NamedTuple):
    """The outcome of :func:`verify` for a batch of ``B`` verify steps with ``gamma`` drafts."""

    num_accepted: Tensor
    """``[B]`` int64 in ``0 .. gamma``: how many drafts were accepted (a prefix of the drafts)."""
    tokens: Tensor
    """``[B, gamma + 1]`` int64: the emitted tokens, i.e. the accepted drafts followed by the
    residual (after a rejection) or bonus (after full acceptance) token. Row ``b`` holds
    ``num_accepted[b] + 1`` tokens; the rest of the row is ``-1``."""
    accepted: Tensor
    """``[B, gamma]`` bool: ``accepted[b, i]`` is True iff drafts ``0 .. i`` were all accepted."""
    alpha: Tensor
    """``[B, gamma]`` float: ``sum_v min(p_i, q_i)`` for every draft position, the probability
    that draft ``i`` is accepted given its context (computed for all ``i``, reached or not)."""


def acceptance_probability(p: Tensor, q: Tensor) -> Tensor:
    """``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)``, the rejection-sampling acceptance rate.

    Args:
        p: ``[..., V]`` main-model (target) probabilities.
        q: ``[..., V]`` draft probabilities, same shape.

    Returns:
        ``[...]`` acceptance probabilities in ``[0, 1]``.
    """
    _check_same_shape(p, q, 'p', 'q')
    return torch.minimum(p, q).sum(dim=-1)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """The distribution a rejected draft is replaced from: ``norm(max(p - q, 0))``.

    Where the residual has no mass (``p <= q`` everywhere, i.e. ``p == q`` for normalised
    inputs, where a rejection has probability 0 and can only come from rounding) ``p`` itself
    is returned, which keeps the sampler well defined without changing its distribution.

    Args:
        p: ``[..., V]`` main-model probabilities.
        q: ``[..., V]`` draft probabilities, same shape.

    Returns:
        ``[..., V]`` probabilities, each row summing to 1.
    """
    _check_same_shape(p, q, 'p', 'q')
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def sample(probs: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """One token from each categorical distribution in ``probs``.

    Args:
        probs: ``[..., V]`` non-negative weights (need not be normalised), at least one
            positive entry per row.
        generator: source of randomness (None: torch's default generator).

    Returns:
        ``[...]`` int64 token ids.
    """
    if probs.dim() < 1 or probs.shape[-1] == 0:
        raise ValueError(f"probs must have a non-empty last (vocabulary) dim, got {tuple(probs.shape)}")
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.shape[0] == 0:
        return torch.zeros(probs.shape[:-1], dtype=torch.long, device=probs.device)
    out = torch.multinomial(flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat,
                            1, generator=generator)
    return out.view(probs.shape[:-1])


def verify(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """Rejection-sample ``B`` verify steps of ``gamma`` drafted tokens each.

    Args:
        draft_tokens: ``[B, gamma]`` int64, the drafted tokens ``d_1 .. d_gamma`` (``d_i`` was
            sampled from ``draft_probs[:, i]`` given the earlier drafts).
        draft_probs: ``[B, gamma, V]``, the draft distributions ``q_1 .. q_gamma``.
        target_probs: ``[B, gamma + 1, V]``, the main model's distributions ``p_1 .. p_{gamma+1}``
            at the same positions, computed on the context that contains the drafts; the last one
            is the bonus distribution after ``d_gamma``.
        generator: source of randomness (None: torch's default generator). Per call it draws
            ``B * gamma`` uniforms, then one categorical sample per row.

    Returns:
        A :class:`VerifyResult`. Every emitted token is distributed as ``p`` at its position.

    Raises:
        ValueError: on inconsistent shapes or a draft token outside the vocabulary.
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, gamma], got shape {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, gamma):
        raise ValueError(
            f"draft_probs must be [B, gamma, V] = [{batch}, {gamma}, V], got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[-1]
    if tuple(target_probs.shape) != (batch, gamma + 1, vocab):
        raise ValueError(
            f"target_probs must be [B, gamma + 1, V] = [{batch}, {gamma + 1}, {vocab}], "
            f"got {tuple(target_probs.shape)}"
        )
    if gamma and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}); got values outside")
    draft_tokens = draft_tokens.long()

    p_draft = target_probs[:, :gamma]  # [B, gamma, V]
    index = draft_tokens.unsqueeze(-1)
    p_of_d = p_draft.gather(-1, index).squeeze(-1)  # [B, gamma]
    q_of_d = draft_probs.gather(-1, index).squeeze(-1)
    uniforms = torch.rand(
        (batch, gamma), generator=generator, dtype=p_of_d.dtype, device=p_of_d.device
    )
    # u < p/q without dividing (q may be 0 for a token that could not have been drafted).
    each = uniforms * q_of_d < p_of_d
    accepted = each.long().cumprod(dim=-1).bool()  # a prefix: stop at the first rejection
    num_accepted = accepted.sum(dim=-1)

    # The distribution of the one extra token: residual at the first rejection, else the bonus.
    residuals = residual_distribution(p_draft, draft_probs)  # [B, gamma, V]
    options = torch.cat([residuals, target_probs[:, gamma:]], dim=1)  # [B, gamma + 1, V]
    rows = torch.arange(batch, device=draft_tokens.device)
    extra = sample(options[rows, num_accepted], generator)  # [B]

    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long, device=draft_tokens.device)
    tokens[:, :gamma] = torch.where(accepted, draft_tokens, tokens[:, :gamma])
    tokens[rows, num_accepted] = extra
    alpha = acceptance_probability(p_draft, draft_probs)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens, accepted=accepted, alpha=alpha)


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor) -> VerifyResult:
    """Greedy verification (temperature 0) of ``B`` verify steps of ``gamma`` drafts each.

    Draft ``d_i`` is accepted iff it equals ``argmax p_i`` and every earlier draft was accepted.
    The extra token is ``argmax p`` at the first rejected position, or the bonus ``argmax
    p_{gamma+1}``; the emitted tokens are therefore exactly the main model's greedy decoding.
    Ties go to the lowest token id (``torch.argmax``). No randomness.

    Args:
        draft_tokens: ``[B, gamma]`` int64 drafts (for greedy drafting, the draft model's argmax).
        target_logits: ``[B, gamma + 1, V]`` main-model logits (or probabilities: only the argmax
            is used) at the positions of ``d_1 .. d_gamma`` and after ``d_gamma``.

    Returns:
        A :class:`VerifyResult` whose ``alpha`` is the 0/1 agreement ``1[d_i == argmax p_i]`` at
        every draft position (reached or not), so :func:`rao_blackwell_accepted` returns the count.

    Raises:
        ValueError: on inconsistent shapes or a draft token outside the vocabulary.
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, gamma], got shape {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (batch, gamma + 1):
        raise ValueError(
            f"target_logits must be [B, gamma + 1, V] = [{batch}, {gamma + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[-1]
    if gamma and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}); got values outside")
    greedy = target_logits.argmax(dim=-1)  # [B, gamma + 1]
    agree = draft_tokens.long() == greedy[:, :gamma]
    accepted = agree.long().cumprod(dim=-1).bool()
    num_accepted = accepted.sum(dim=-1)
    rows = torch.arange(batch, device=draft_tokens.device)
    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long, device=draft_tokens.device)
    tokens[:, :gamma] = torch.where(accepted, draft_tokens.long(), tokens[:, :gamma])
    tokens[rows, num_accepted] = greedy[rows, num_accepted]
    alpha = agree.to(target_logits.dtype if target_logits.is_floating_point() else torch.float32)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens, accepted=accepted, alpha=alpha)


def probabilities(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Sampling distribution at ``temperature``: ``softmax(logits / T)`` over the last dim, in fp32
    (or the input's dtype if wider).

    Args:
        logits: ``[..., V]``.
        temperature: ``T > 0`` and finite; greedy decoding (``T = 0``) has no distribution, use
            :func:`verify_greedy` and ``argmax``.

    Raises:
        ValueError: for ``T <= 0``, NaN or infinity.
    """
    t = float(temperature)
    if not (0.0 < t < float('inf')):
        raise ValueError(
            f"temperature={temperature!r} must be a finite number > 0 (for greedy decoding, "
            "T = 0, use argmax and verify_greedy)"
        )
    z = logits if logits.dtype == torch.float64 else logits.float()
    return torch.softmax(z / t if t != 1.0 else z, dim=-1)


def expected_accepted_drafts(alpha: Tensor) -> Tensor:
    """Expected accepted drafts per verify step, ``sum_j prod_{i<=j} alpha_i``.

    Args:
        alpha: ``[..., gamma]`` per-depth acceptance probabilities along one draft chain.

    Returns:
        ``[...]``; add 1 for the expected number of emitted tokens per verify step.
    """
    return alpha.cumprod(dim=-1).sum(dim=-1)


def rao_blackwell_accepted(result: VerifyResult) -> Tensor:
    """A lower-variance unbiased estimate of the accepted-draft count of each verify step.

    ``P(drafts 1..j accepted) = E[1(drafts 1..j-1 accepted) * alpha_j]``, because given its
    context draft ``j`` is accepted with probability exactly ``alpha_j``. Summing over ``j``
    replaces each accept/reject coin by its probability; the mean over many steps estimates the
    same expectation as ``result.num_accepted.mean()``, with a smaller standard error.

    Args:
        result: a :class:`VerifyResult`.

    Returns:
        ``[B]`` float.
    """
    reached = torch.cat(
        [torch.ones_like(result.accepted[:, :1]), result.accepted[:, :-1]], dim=-1
    )  # [B, gamma]: drafts before j all accepted
    return (reached.to(result.alpha.dtype) * result.alpha).sum(dim=-1)


def _check_same_shape(a: Tensor, b: Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
