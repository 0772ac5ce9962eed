"""What serving sees: acceptance of the MTP heads over long contexts, teacher-forced and in real
speculative decoding with a KV cache.

* :class:`TeacherForcedSet`: held-out windows (real text, or the main model's own sampled
  continuations of real prompts: what speculative decoding drafts on) with the frozen backbone's
  states, computed once per backbone and shared by every arm (the main model's logits are
  projected from them when scored). :func:`teacher_forced` scores one model's heads on it: depth ``k`` at
  position ``t`` (context ``>= t0`` tokens) drafts ``q_k[t]`` for token ``t+k+2``, the main model
  predicts that token with ``p[t+k+1]``; ``alpha_k = sum_v min(p_T, q_T)`` at T=1 and at a serving
  temperature, the greedy agreement ``1[argmax q == argmax p]``, and the accepted drafts per
  verify step they predict, ``sum_j prod_{i<=j} alpha_i``.
* :func:`speculative_decoding`: the heads draft ``gamma`` tokens autoregressively from the end of
  a prompt, the main model verifies them in one pass over the KV cache (rejection sampling at T,
  :func:`mtp_tv_dev.speculative.verify`; or greedy), the accepted drafts and the one extra
  token are committed, and the next round drafts from there: ``rounds`` verify steps per prompt
  on generated continuations. The prompts' KV cache (:class:`Prompts`) is computed once per
  backbone and copied for every arm.

Standard errors treat a window (teacher-forced) or a prompt (speculative) as the unit: positions
of one window, and verify steps of one continuation, are correlated. Paired comparisons use the
per-window / per-prompt means of two models on the same windows / prompts and seeds.
"""

import math
from dataclasses import dataclass
from typing import Dict

import torch
from torch import Tensor

from mtp_tv_dev.speculative import probabilities, rao_blackwell_accepted, verify, verify_greedy

from cpu_demo_lib.model import mtp_depth
from .decode import (DecoderCache, MTPDepthCache, arange_positions, gather_steps, logits,
                     scatter_steps)

SAMPLED, GREEDY, SERVING = 'sampled', 'greedy', 'serving'


def mean_and_se(per_unit: Tensor) -> Dict:
    """Mean and standard error over independent units (dim 0), and the per-unit values."""
    values = per_unit.double().flatten()
    n = values.numel()
    se = float(values.std(unbiased=True) / math.sqrt(n)) if n > 1 else float('nan')
    return {'mean': float(values.mean()), 'se': se, 'n': n}


# --------------------------------------------------------------------------- teacher-forced


@dataclass
class TeacherForcedSet:
    """Windows ``[N, S]`` and their main states ``[S, N, h]``: everything a depth ``k < gamma``
    needs at the scored positions ``t0 .. S - 2 - gamma``. The main model's logits (the
    target ``p``) are projected from the states batch by batch when scored, not kept: kept,
    they would be ``[S - 1 - t0, N, V]`` fp32, 6 GB for 128 windows of 512 tokens."""

    name: str
    windows: Tensor
    states: Tensor
    t0: int

    @classmethod
    def build(cls, name: str, model, windows: Tensor, states: Tensor,
              t0: int) -> 'TeacherForcedSet':
        del model  # the states are the model's; the targets are projected when scored
        return cls(name, windows, states, t0)

    def positions(self, gamma: int) -> int:
        return self.windows.shape[1] - 1 - gamma - self.t0

    def target_logits(self, model, start: int, stop: int) -> Tensor:
        """The main logits at positions ``t0 + 1 .. S - 1`` of windows ``start:stop``:
        ``[S - 1 - t0, stop - start, V]`` fp32."""
        return logits(model, self.states[self.t0 + 1 :, start:stop])


@torch.no_grad()
def teacher_forced(model, data: TeacherForcedSet, gamma: int, serving_temperature: float,
                   batch: int = 4) -> Dict:
    """Per mode (T=1 ``'sampled'``, ``'greedy'``, ``'serving'``): ``alpha`` per depth and
    ``accepted`` (predicted accepted drafts per verify step), mean and SE over windows, plus
    ``per_window`` accepted (for paired differences) and ``positions`` scored."""
    temps = {SAMPLED: 1.0, GREEDY: 0.0, SERVING: serving_temperature}
    count = data.positions(gamma)
    if count < 1:
        raise ValueError(f'windows of {data.windows.shape[1]} tokens score no position after '
                         f't0={data.t0} with gamma={gamma}')
    per_mode = {name: [] for name in temps}  # [N, count, gamma] per mode
    for start in range(0, data.windows.shape[0], batch):
        tokens = data.windows[start : start + batch]
        hidden = data.states[:, start : start + batch]
        alphas = {name: [] for name in temps}
        target = data.target_logits(model, start, start + tokens.shape[0])
        for k in range(gamma):
            hidden = mtp_depth(model, k, hidden, tokens)  # the whole window: causal context
            z_q = logits(model, hidden[data.t0 : data.t0 + count])  # [count, b, V]
            z_p = target[k : k + count]  # p at t + k + 1
            for name, t in temps.items():
                if t == 0:
                    alphas[name].append((z_q.argmax(-1) == z_p.argmax(-1)).float())
                else:
                    alphas[name].append(torch.minimum(probabilities(z_q, t),
                                                      probabilities(z_p, t)).sum(-1))
            del z_q
        del target
        for name in temps:
            per_mode[name].append(torch.stack(alphas[name], -1).transpose(0, 1))
    out = {}
    for name in temps:
        alpha = torch.cat(per_mode[name])  # [N, count, gamma]
        accepted = alpha.cumprod(-1).sum(-1).mean(1)  # per window
        out[name] = {'alpha': [mean_and_se(alpha[:, :, k].mean(1)) for k in range(gamma)],
                     'accepted': mean_and_se(accepted), 'per_window': accepted.tolist(),
                     'positions': int(alpha.shape[0] * alpha.shape[1])}
    out['temperatures'] = temps
    return out


# --------------------------------------------------------------------------- continuations


@torch.no_grad()
def generate(model, prompts: Tensor, new_tokens: int, temperature: float, seed: int,
             batch: int = 32) -> Tensor:
    """The main model's own continuations of ``prompts`` ``[P, n]``: ``[P, n + new_tokens]``,
    sampled at ``temperature`` (0: greedy) through the KV cache."""
    out = []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, prompts.shape[0], batch):
        seq = prompts[start : start + batch]
        rows, n = seq.shape
        cache = DecoderCache(model, rows, n + new_tokens)
        hidden = cache.extend(seq, arange_positions(torch.zeros(rows, dtype=torch.long), n))[-1:]
        for i in range(new_tokens):
            z = logits(model, hidden[0])  # [rows, V]
            token = (z.argmax(-1, keepdim=True) if temperature == 0 else torch.multinomial(
                probabilities(z, temperature), 1, generator=generator))
            seq = torch.cat([seq, token], dim=1)
            if i + 1 < new_tokens:
                hidden = cache.extend(token, torch.full((rows, 1), n + i, dtype=torch.long))
        out.append(seq)
    return torch.cat(out)


# --------------------------------------------------------------------------- speculative


@dataclass
class Prompts:
    """Prompts ``[P, n]`` after the frozen backbone's prefill: its KV cache (room for
    ``capacity`` tokens), its output states ``[n, P, h]`` and the logits of the last position
    ``[P, V]`` (the distribution of the first token the main model emits)."""

    tokens: Tensor
    cache: DecoderCache
    states: Tensor
    last_logits: Tensor

    @classmethod
    @torch.no_grad()
    def prefill(cls, model, tokens: Tensor, capacity: int, batch: int = 16) -> 'Prompts':
        parts, states = [], []
        for start in range(0, tokens.shape[0], batch):
            chunk = tokens[start : start + batch]
            parts.append(DecoderCache(model, chunk.shape[0], capacity))
            states.append(parts[-1].extend(chunk, arange_positions(
                torch.zeros(chunk.shape[0], dtype=torch.long), chunk.shape[1])))
        states = torch.cat(states, dim=1)
        return cls(tokens, DecoderCache.concat(parts), states, logits(model, states[-1]))


@torch.no_grad()
def speculative_decoding(model, prompts: Prompts, gamma: int, rounds: int, temperature: float,
                         seed: int, trace: bool = False) -> Dict:
    """``rounds`` verify steps of ``gamma`` drafts from every prompt, all prompts in one ragged
    batch. ``seed`` seeds every random draw, so every model is run on common random numbers
    (identical until their drafts differ). Returns accepted drafts per verify step (``accepted``,
    mean and SE over prompts), ``tokens_per_step`` (one more), ``accepted_rao_blackwell`` (the
    same expectation from the on-path alphas), per-depth acceptance given reached, per-prompt
    means (for paired differences) and the number of verify steps. ``trace`` (for tests) adds
    each prompt's committed ``tokens`` (``[P, capacity]``, valid up to ``lengths``),
    ``accepted_per_step`` (``[P, rounds]``) and ``draft_logits`` (``[P, rounds, gamma, V]``)."""
    greedy = temperature == 0
    generator = torch.Generator().manual_seed(seed)
    rows, n = prompts.tokens.shape
    capacity = prompts.cache.capacity
    need = n + rounds * (gamma + 1) + 2 * gamma + 2
    if need > capacity:
        raise ValueError(f'prompts prefilled with room for {capacity} tokens; {rounds} rounds '
                         f'of gamma={gamma} need {need}')
    main_cache = prompts.cache.clone()
    depths = [MTPDepthCache(model, k, rows, capacity) for k in range(gamma)]
    depth_valid = [torch.zeros(rows, dtype=torch.long) for _ in range(gamma)]
    hidden = prompts.states.new_zeros(capacity, rows, prompts.states.shape[-1])
    stores = [hidden] + [torch.zeros_like(hidden) for _ in range(gamma)]  # main, depth 0 ..
    stores[0][:n] = prompts.states
    tokens = torch.zeros(rows, capacity, dtype=torch.long)
    tokens[:, :n] = prompts.tokens

    def draw(z: Tensor):
        if greedy:
            return z.argmax(-1), None
        q = probabilities(z, temperature)
        return torch.multinomial(q, 1, generator=generator).squeeze(1), q

    all_rows = torch.arange(rows)
    first, _ = draw(prompts.last_logits)
    tokens[:, n] = first
    last = torch.full((rows,), n, dtype=torch.long)  # the emitted token the main model has not read
    accepted_steps, rb_steps, reached_steps, hit_steps, traced = [], [], [], [], []
    for _ in range(rounds):
        drafts, draft_probs = [], []
        for k, depth in enumerate(depths):
            # depth k at position t reads store k (main or depth k-1) at t and token t + k + 1;
            # it feeds every position its cache lacks, up to the drafting position last - 1.
            start = depth_valid[k]
            count = int((last - start).max())
            positions = arange_positions(start, count)
            out = depth.extend(gather_steps(stores[k], positions),
                               tokens.gather(1, positions + k + 1), positions)
            scatter_steps(stores[k + 1], positions, out)
            z_draft = logits(model, stores[k + 1][last - 1, all_rows])  # [P, V]
            token, q = draw(z_draft)
            if trace:
                traced.append(z_draft)
            tokens[all_rows, last + k + 1] = token
            drafts.append(token)
            draft_probs.append(q)
            depth_valid[k] = last - k  # later positions read drafted tokens: fed again next round
        positions = arange_positions(last, gamma + 1)  # the emitted token and the drafts
        verified = main_cache.extend(tokens.gather(1, positions), positions)
        scatter_steps(stores[0], positions, verified)
        z_main = logits(model, verified).transpose(0, 1)  # [P, gamma + 1, V]
        drafted = torch.stack(drafts, dim=1)
        if greedy:
            result = verify_greedy(drafted, z_main)
        else:
            result = verify(drafted, torch.stack(draft_probs, dim=1),
                            probabilities(z_main, temperature), generator)
        emitted = result.num_accepted + 1  # accepted drafts and the residual or bonus token
        write = torch.arange(gamma + 1) < emitted.unsqueeze(1)
        targets = positions + 1
        tokens[all_rows.unsqueeze(1).expand_as(targets)[write], targets[write]] = result.tokens[write]
        last = last + emitted
        accepted_steps.append(result.num_accepted)
        rb_steps.append(rao_blackwell_accepted(result))
        reached_steps.append(torch.cat([torch.ones_like(result.accepted[:, :1]),
                                        result.accepted[:, :-1]], dim=1))  # drafts before k kept
        hit_steps.append(result.accepted)
    counts = torch.stack(accepted_steps, dim=1).double()  # [P, rounds]
    per_prompt = counts.mean(1)
    reached, hits = torch.cat(reached_steps), torch.cat(hit_steps)
    depth_acceptance = [float(hits[reached[:, k], k].double().mean()) if reached[:, k].any()
                        else float('nan') for k in range(gamma)]
    summary = mean_and_se(per_prompt)
    per_prompt_rb = torch.stack(rb_steps, dim=1).double().mean(1)
    extra = ({'tokens': tokens, 'lengths': last + 1, 'accepted_per_step': counts.long(),
              'draft_logits': torch.stack(traced, 1).view(rows, rounds, gamma, -1)}
             if trace else {})
    return {**extra, 'accepted': summary,
            'tokens_per_step': {**summary, 'mean': summary['mean'] + 1.0},
            'accepted_rao_blackwell': mean_and_se(per_prompt_rb),
            'per_prompt_rao_blackwell': per_prompt_rb.tolist(),
            'depth_acceptance_given_reached': depth_acceptance,
            'per_prompt': per_prompt.tolist(), 'verify_steps': int(counts.numel()),
            'temperature': float(temperature)}

