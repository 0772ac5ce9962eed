"""Acceptance of the MTP draft heads: teacher-forced prediction and real speculative decoding.

Both are computed here from logits, independently of the plugin's loss code.

Teacher-forced (what the training metrics measure): on held-out windows of real text, depth k at
position t (which has read the true tokens up to t+k+1) drafts ``q_k[t]`` for token t+k+2, and the
main model predicts that token with ``p[t+k+1]``. ``alpha_k[t] = sum_v min(p[t+k+1], q_k[t])`` and
the predicted accepted drafts per verify step are ``sum_j prod_{i<=j} alpha_i[t]`` (per position,
then averaged).

Speculative decoding (what serving gets): for a prompt ``x_0..x_n`` the main model samples
``x_{n+1} ~ p`` (the token the previous verify step would have emitted), depth 0 reads the main
hidden state at n and ``x_{n+1}`` and drafts ``d_1 ~ q_0``; depth k reads depth k-1's hidden state
at n and ``d_k`` and drafts ``d_{k+1}`` -- i.e. the model runs on ``[prompt, x_{n+1}, d_1..d_k]``
and we read depth k at position n. The main model then scores ``[prompt, x_{n+1}, d_1..d_gamma]``
once and :func:`megatron.mtp_tv.speculative.verify` accepts or rejects at temperature 1 (no top-k).
The count of accepted drafts is the empirical number. Differences from the teacher-forced number
come from the inputs: there the heads read real text, here they read sampled tokens (``x_{n+1}``
from p, deeper depths their own drafts), and the verifier's p is conditioned on those drafts too.
"""

import math
from typing import Dict, List

import torch

from megatron.mtp_tv.speculative import rao_blackwell_accepted, verify

from .model import hidden_states, project


def mean_and_se(values: torch.Tensor) -> Dict[str, float]:
    """Mean and standard error of the mean over dim 0 of a 1-D tensor (independent units)."""
    values = values.double().flatten()
    n = values.numel()
    se = float(values.std(unbiased=True) / math.sqrt(n)) if n > 1 else float('nan')
    return {'mean': float(values.mean()), 'se': se, 'n': n}


@torch.no_grad()
def teacher_forced(model, windows: torch.Tensor, gamma: int, batch_size: int = 64) -> Dict:
    """Per-depth alpha and predicted accepted drafts on real text.

    Args:
        windows: ``[N, s]`` held-out token windows.
        gamma: number of draft depths used (<= the model's MTP depth).

    Returns:
        ``alpha`` (list of gamma mean/se dicts), ``accepted`` (mean/se), both averaged over the
        positions ``t = 0 .. s-1-gamma`` of each window, with standard errors across windows; and
        ``*_at_prompt_end``, the same at the single position ``t = s-2-gamma`` that the
        speculative run drafts from (``windows[:, :s-1-gamma]`` are its prompts), for an
        apples-to-apples comparison (``accepted_at_prompt_end_per_window`` for paired ones).
    """
    num, seq = windows.shape
    last = seq - 1 - gamma  # last position whose gamma targets all lie inside the window
    if last < 1:
        raise ValueError(f'seq_length {seq} is too short for gamma={gamma}')
    per_window_alpha, per_window_accepted, end_alpha, end_accepted = [], [], [], []
    for start in range(0, num, batch_size):
        tokens = windows[start : start + batch_size]
        states = hidden_states(model, tokens, gamma)
        p = torch.softmax(project(model, states[0]), dim=-1)  # [s, b, V]
        alphas = []
        for k in range(gamma):
            q = torch.softmax(project(model, states[k + 1][: last + 1]), dim=-1)
            target = p[k + 1 : k + 2 + last]
            alphas.append(torch.minimum(q, target).sum(-1))  # [last+1, b]
        alpha = torch.stack(alphas, dim=-1)  # [t, b, gamma]
        accepted = alpha.cumprod(-1).sum(-1)  # [t, b]
        per_window_alpha.append(alpha.mean(0))
        per_window_accepted.append(accepted.mean(0))
        end_alpha.append(alpha[last - 1])
        end_accepted.append(accepted[last - 1])
    alpha = torch.cat(per_window_alpha)  # [N, gamma]
    accepted = torch.cat(per_window_accepted)
    end_alpha, end_accepted = torch.cat(end_alpha), torch.cat(end_accepted)
    return {
        'alpha': [mean_and_se(alpha[:, k]) for k in range(gamma)],
        'accepted': mean_and_se(accepted),
        'alpha_at_prompt_end': [mean_and_se(end_alpha[:, k]) for k in range(gamma)],
        'accepted_at_prompt_end': mean_and_se(end_accepted),
        'accepted_at_prompt_end_per_window': end_accepted.tolist(),
    }


@torch.no_grad()
def speculative_decoding(
    model, prompts: torch.Tensor, gamma: int, seed: int, batch_size: int = 256
) -> Dict:
    """One speculative verify step from each prompt, drafting with the MTP heads.

    Args:
        prompts: ``[P, n+1]`` token prefixes (real held-out text).
        gamma: drafts per verify step (<= the model's MTP depth).
        seed: seeds the sampling generator; the same seed gives the same draws for every model,
            so arms are compared on common random numbers.

    Returns:
        ``accepted`` (mean/se of accepted drafts per verify step over prompts), ``tokens_per_step``
        (one more), ``accepted_rao_blackwell`` (the same expectation from the on-path alphas,
        lower variance), ``depth_acceptance`` (per depth: accepted / reached), and
        ``per_prompt`` counts (for paired comparisons between arms).
    """
    generator = torch.Generator().manual_seed(seed)
    n = prompts.shape[1] - 1
    counts, rb, accepted_rows = [], [], []
    for start in range(0, prompts.shape[0], batch_size):
        seq = prompts[start : start + batch_size]
        main = hidden_states(model, seq, 0)[0]
        p_next = torch.softmax(project(model, main[n : n + 1]), dim=-1)[0]  # [b, V]
        seq = torch.cat([seq, torch.multinomial(p_next, 1, generator=generator)], dim=1)
        drafts, draft_probs = [], []
        for k in range(gamma):
            depth_k = hidden_states(model, seq, k + 1)[k + 1]
            q = torch.softmax(project(model, depth_k[n : n + 1]), dim=-1)[0]  # [b, V]
            token = torch.multinomial(q, 1, generator=generator)
            drafts.append(token)
            draft_probs.append(q)
            seq = torch.cat([seq, token], dim=1)
        main = hidden_states(model, seq, 0)[0]
        p = torch.softmax(project(model, main[n + 1 : n + gamma + 2]), dim=-1)  # [gamma+1, b, V]
        result = verify(
            torch.cat(drafts, dim=1), torch.stack(draft_probs, dim=1), p.transpose(0, 1), generator
        )
        counts.append(result.num_accepted)
        rb.append(rao_blackwell_accepted(result))
        accepted_rows.append(result.accepted)
    counts = torch.cat(counts)
    accepted = torch.cat(accepted_rows)  # [P, gamma]
    reached = torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], dim=1)
    depth_acceptance: List[Dict] = []
    for k in range(gamma):
        hits = accepted[reached[:, k], k]
        depth_acceptance.append(mean_and_se(hits) if hits.numel() else {'mean': float('nan'),
                                                                         'se': float('nan'), 'n': 0})
    summary = mean_and_se(counts)
    return {
        'accepted': summary,
        'tokens_per_step': {**summary, 'mean': summary['mean'] + 1.0},
        'accepted_rao_blackwell': mean_and_se(torch.cat(rb)),
        'depth_acceptance': depth_acceptance,
        'per_prompt': counts.tolist(),
    }
