"""Acceptance of the MTP draft heads: teacher-forced prediction and real speculative decoding.

Both are computed here from logits, independently of the plugin's loss code, in three serving
modes: sampling at temperature 1 (``'sampled'``), greedy (``'greedy'``, temperature 0) and
sampling at a serving temperature T (``'serving'``, e.g. 0.7).

Teacher-forced (what the training metrics measure): on held-out windows of real text, depth k at
position t (which has read the true tokens up to t+k+1) drafts ``q_k[t]`` for token t+k+2, and the
main model predicts that token with ``p[t+k+1]``. ``alpha_k[t] = sum_v min(p_T[t+k+1], q_T,k[t])``
with both sides ``softmax(z / T)`` (greedy: ``alpha_k[t] = 1[argmax q_k[t] == argmax p[t+k+1]]``,
the greedy agreement) and the predicted accepted drafts per verify step are
``sum_j prod_{i<=j} alpha_i[t]`` (per position, then averaged).

Speculative decoding (what serving gets): for a prompt ``x_0..x_n`` the main model draws
``x_{n+1}`` from p (the token the previous verify step would have emitted), depth 0 reads the main
hidden state at n and ``x_{n+1}`` and drafts ``d_1`` from ``q_0``; depth k reads depth k-1's hidden
state at n and ``d_k`` and drafts ``d_{k+1}``. Each depth runs once over the whole verify sequence
``[prompt, x_{n+1}, d_1..d_gamma]`` with the drafts not drawn yet left as placeholders: depth k at
n reads tokens up to ``n+k+1`` only, and causal attention keeps later positions out. The main model
then scores the sequence once and :func:`mtp_tv_dev.speculative.verify` accepts or rejects
(rejection sampling at T, no top-k; greedy: :func:`~mtp_tv_dev.speculative.verify_greedy`,
drafts and ``x_{n+1}`` are argmaxes). The count of accepted drafts is the empirical number.
Differences from the teacher-forced number come from the inputs: there the heads read real text,
here they read drawn tokens (``x_{n+1}`` from p, deeper depths their own drafts), and the
verifier's p is conditioned on those drafts too.
"""

import math
from typing import Dict, List, Optional

import torch

from mtp_tv_dev.speculative import probabilities, rao_blackwell_accepted, verify, verify_greedy

from .model import hidden_states, main_states, mtp_depth, project

#: Serving modes by name: the temperature (0 = greedy).
SAMPLED, GREEDY, SERVING = 'sampled', 'greedy', 'serving'


def mean_and_se(values: torch.Tensor) -> Dict[str, float]:
    """Mean and standard error of the mean over dim 0 of a 1-D tensor (independent units)."""
    values = values.double().flatten()
    n = values.numel()
    se = float(values.std(unbiased=True) / math.sqrt(n)) if n > 1 else float('nan')
    return {'mean': float(values.mean()), 'se': se, 'n': n}


def _chain_stats(alpha: torch.Tensor, last: int) -> Dict:
    """Summaries of per-window, per-position acceptance ``alpha`` ``[N, t, gamma]``."""
    accepted = alpha.cumprod(-1).sum(-1)  # [N, t]
    gamma = alpha.shape[-1]
    end_alpha, end_accepted = alpha[:, last - 1], accepted[:, last - 1]
    return {
        'alpha': [mean_and_se(alpha.mean(1)[:, k]) for k in range(gamma)],
        'accepted': mean_and_se(accepted.mean(1)),
        'alpha_at_prompt_end': [mean_and_se(end_alpha[:, k]) for k in range(gamma)],
        'accepted_at_prompt_end': mean_and_se(end_accepted),
        'accepted_at_prompt_end_per_window': end_accepted.tolist(),
    }


@torch.no_grad()
def teacher_forced_modes(model, windows: torch.Tensor, gamma: int, modes: Dict[str, float],
                         batch_size: int = 64,
                         main: Optional[torch.Tensor] = None) -> Dict[str, Dict]:
    """Per-depth acceptance and predicted accepted drafts on real text, for several serving modes
    from one forward pass.

    Args:
        windows: ``[N, s]`` held-out token windows.
        gamma: number of draft depths used (<= the model's MTP depth).
        modes: name -> temperature (``0``: greedy agreement instead of ``sum min``).
        main: ``[s, N, h]`` the main decoder's states of ``windows`` computed before (a frozen
            backbone's, cached); None: computed here.

    Returns:
        Per mode: ``alpha`` (list of gamma mean/se dicts; greedy: the agreement rate),
        ``accepted`` (mean/se), both averaged over the positions ``t = 0 .. s-1-gamma`` of each
        window, with standard errors across windows; and ``*_at_prompt_end``, the same at the
        single position ``t = s-2-gamma`` that the speculative run drafts from
        (``windows[:, :s-1-gamma]`` are its prompts), for an apples-to-apples comparison
        (``accepted_at_prompt_end_per_window`` for paired ones). Sampling modes also give the
        per-row L1 norm of the logit gradient of each loss at this point, mean over positions,
        per depth: ``tv_logit_grad_l1 = 2 s (1 - s)`` with ``s = sum_{q<p} q`` (TV's gradient
        ``q (dot - 1[q < p])`` vanishes as the overlap does) and ``kl_logit_grad_l1 =
        |q - p|_1 = 2 (1 - alpha)`` (the KL gradient ``q - p``); both before the ``1/T`` factor.
    """
    num, seq = windows.shape
    last = seq - 1 - gamma  # last position whose gamma targets all lie inside the window
    if last < 1:
        raise ValueError(f'seq_length {seq} is too short for gamma={gamma}')
    per_mode: Dict[str, List[torch.Tensor]] = {name: [] for name in modes}
    grads: Dict[str, List[torch.Tensor]] = {name: [] for name, t in modes.items() if t > 0}
    for start in range(0, num, batch_size):
        tokens = windows[start : start + batch_size]
        states = hidden_states(model, tokens, gamma,
                               None if main is None else main[:, start : start + batch_size])
        z_main = project(model, states[0])  # [s, b, V]
        targets = {name: (z_main.argmax(-1) if t == 0 else probabilities(z_main, t))
                   for name, t in modes.items()}
        alphas = {name: [] for name in modes}
        batch_grads = {name: [] for name in grads}
        for k in range(gamma):
            z_draft = project(model, states[k + 1][: last + 1])  # [t, b, V]
            for name, t in modes.items():
                target = targets[name][k + 1 : k + 2 + last]
                if t == 0:
                    alphas[name].append((z_draft.argmax(-1) == target).float())
                    continue
                q = probabilities(z_draft, t)
                alpha = torch.minimum(q, target).sum(-1)  # [t, b]
                s_under = torch.where(q < target, q, torch.zeros_like(q)).sum(-1)
                alphas[name].append(alpha)
                batch_grads[name].append(torch.stack(
                    [2 * s_under * (1 - s_under), 2 * (1 - alpha)], -1).mean(0))  # [b, 2]
        for name in modes:
            per_mode[name].append(torch.stack(alphas[name], -1).transpose(0, 1))  # [b, t, gamma]
        for name in grads:
            grads[name].append(torch.stack(batch_grads[name], 1))  # [b, gamma, 2]
    out = {}
    for name in modes:
        out[name] = _chain_stats(torch.cat(per_mode[name]), last)
        if name in grads:
            g = torch.cat(grads[name])  # [N, gamma, 2]
            out[name]['tv_logit_grad_l1'] = [mean_and_se(g[:, k, 0]) for k in range(gamma)]
            out[name]['kl_logit_grad_l1'] = [mean_and_se(g[:, k, 1]) for k in range(gamma)]
    return out


def teacher_forced(model, windows: torch.Tensor, gamma: int, batch_size: int = 64) -> Dict:
    """:func:`teacher_forced_modes` at temperature 1 alone."""
    return teacher_forced_modes(model, windows, gamma, {SAMPLED: 1.0}, batch_size)[SAMPLED]


@torch.no_grad()
def speculative_decoding(
    model, prompts: torch.Tensor, gamma: int, seed: int, temperature: float = 1.0,
    batch_size: int = 256, prompt_states: Optional[torch.Tensor] = None,
) -> Dict:
    """One speculative verify step from each prompt, drafting with the MTP heads.

    Args:
        prompts: ``[P, n+1]`` token prefixes (real held-out text).
        gamma: drafts per verify step (<= the model's MTP depth).
        seed: seeds the sampling generator; the same seed gives the same draws for every model,
            so arms are compared on common random numbers.
        temperature: both models sample at it; 0 is greedy (argmax drafts, greedy verification,
            no randomness).
        prompt_states: ``[n+1, P, h]`` the main decoder's states of ``prompts`` computed before
            (a frozen backbone's, cached); None: computed here. The verify pass over the drafts
            always runs the decoder.

    Returns:
        ``accepted`` (mean/se of accepted drafts per verify step over prompts), ``tokens_per_step``
        (one more), ``accepted_rao_blackwell`` (the same expectation from the on-path alphas,
        lower variance; greedy: equal to ``accepted``), ``depth_acceptance`` (per depth: accepted
        / reached), ``temperature`` and ``per_prompt`` counts (for paired comparisons).
    """
    greedy = temperature == 0
    if not greedy:
        probabilities(torch.zeros(1), temperature)  # validates the temperature
    generator = torch.Generator().manual_seed(seed)
    n = prompts.shape[1] - 1

    def draw(logits):  # [b, V] -> ([b, 1] tokens, [b, V] probabilities or None)
        if greedy:
            return logits.argmax(-1, keepdim=True), None
        probs = probabilities(logits, temperature)
        return torch.multinomial(probs, 1, generator=generator), probs

    counts, rb, accepted_rows = [], [], []
    for start in range(0, prompts.shape[0], batch_size):
        prompt = prompts[start : start + batch_size]
        seq = torch.cat([prompt, prompt.new_zeros(prompt.shape[0], gamma + 1)], dim=1)
        if prompt_states is None:
            hidden = main_states(model, seq)  # positions <= n see only the prompt
        else:  # later positions are never read at position n (causal): zeros stand in for them
            cached = prompt_states[:, start : start + batch_size]
            hidden = torch.cat([cached, cached.new_zeros(gamma + 1, *cached.shape[1:])])
        token, _ = draw(project(model, hidden[n : n + 1])[0])
        seq[:, n + 1 : n + 2] = token
        drafts, draft_probs = [], []
        for k in range(gamma):
            hidden = mtp_depth(model, k, hidden, seq)  # position n reads tokens <= n + k + 1
            token, q = draw(project(model, hidden[n : n + 1])[0])
            seq[:, n + k + 2 : n + k + 3] = token
            drafts.append(token)
            draft_probs.append(q)
        z_main = project(model, main_states(model, seq)[n + 1 : n + gamma + 2])  # [gamma+1, b, V]
        if greedy:
            result = verify_greedy(torch.cat(drafts, dim=1), z_main.transpose(0, 1))
        else:
            result = verify(torch.cat(drafts, dim=1), torch.stack(draft_probs, dim=1),
                            probabilities(z_main, temperature).transpose(0, 1), generator)
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
        'temperature': float(temperature),
        'per_prompt': counts.tolist(),
    }
