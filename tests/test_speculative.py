"""The speculative-sampling verifier, with no model: known p and q, many samples.

The project's core claim is that under rejection sampling a draft is accepted with probability
``sum_v min(p, q)`` and the emitted tokens are distributed as the main model's ``p``. Here both
are checked statistically for ``mtp_tv_dev.speculative.verify``:

* the number of accepted drafts per step follows ``P(N = j) = prod_{i<j} alpha_i (1 - alpha_j)``
  (chi-square), and the per-depth acceptance rate matches ``alpha_i`` within a few standard errors;
* the token emitted at every output position is distributed as ``p`` there (chi-square and a TV
  bound), whether it is an accepted draft, a residual token or the bonus token.

The same checks are run on deliberately wrong verifiers (accept every draft; resample rejections
from ``p`` instead of the residual; resample from ``q``; take the bonus from the wrong position)
and must reject each of them: this is what shows the checks can fail.

All runs are seeded, so the outcome is deterministic; the thresholds (p-value 1e-4, 4.5 standard
errors) leave a correct verifier a wide margin and a wrong one none (their p-values are ~0).
"""

import math

import pytest
import torch

from mtp_tv_dev import speculative
from mtp_tv_dev.speculative import (
    VerifyResult,
    acceptance_probability,
    expected_accepted_drafts,
    probabilities,
    rao_blackwell_accepted,
    residual_distribution,
    verify,
    verify_greedy,
)

V = 8
GAMMA = 3
N = 200_000
P_VALUE = 1e-4
Z_MAX = 4.5


def _distributions(seed=0, gamma=GAMMA, vocab=V):
    """Fixed p_1..p_{gamma+1} and q_1..q_gamma (Dirichlet(1)), float64."""
    g = torch.Generator().manual_seed(seed)
    gamma_dist = lambda *shape: -torch.log(torch.rand(*shape, generator=g, dtype=torch.float64))  # noqa: E731
    p = gamma_dist(gamma + 1, vocab)
    q = gamma_dist(gamma, vocab)
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _draft(q, n, seed):
    """n independent draft chains; here q_i does not depend on earlier drafts."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q_i, n, replacement=True, generator=g) for q_i in q], 1)


def _run(verifier, p, q, n=N, seed=1):
    drafts = _draft(q, n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return verifier(drafts, q.expand(n, *q.shape), p.expand(n, *p.shape), gen)


def chi_square_p_value(counts, probs, min_expected=5.0):
    """Pearson chi-square goodness of fit p-value (bins with a small expectation merged)."""
    counts = counts.double()
    expected = probs.double() * counts.sum()
    order = torch.argsort(expected)
    counts, expected = counts[order], expected[order]
    merged_c, merged_e, acc_c, acc_e = [], [], 0.0, 0.0
    for c, e in zip(counts.tolist(), expected.tolist()):
        acc_c, acc_e = acc_c + c, acc_e + e
        if acc_e >= min_expected:
            merged_c.append(acc_c)
            merged_e.append(acc_e)
            acc_c = acc_e = 0.0
    if acc_e > 0 or acc_c > 0:
        if merged_e:
            merged_c[-1] += acc_c
            merged_e[-1] += acc_e
        else:
            return 1.0
    c, e = torch.tensor(merged_c), torch.tensor(merged_e)
    if (e == 0).any():
        return 0.0 if (c[e == 0] > 0).any() else 1.0
    stat = ((c - e) ** 2 / e).sum()
    df = len(merged_c) - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def sampler_checks(result: VerifyResult, p, q):
    """Every statistic the claim implies; returns a dict of p-values / z-scores / TV distances."""
    gamma = q.shape[0]
    alpha = acceptance_probability(p[:gamma], q)  # [gamma]
    n = result.num_accepted.numel()
    out = {}
    # Number of accepted drafts: P(N = j) = prod_{i<j} alpha_i * (1 - alpha_j), P(N = gamma) = prod.
    reach = torch.cat([torch.ones(1, dtype=alpha.dtype), alpha.cumprod(0)])  # P(N >= j)
    exact = reach[:-1] - reach[1:]
    exact = torch.cat([exact, reach[-1:]])
    counts = torch.bincount(result.num_accepted, minlength=gamma + 1)[: gamma + 1]
    out['num_accepted_p'] = chi_square_p_value(counts, exact)
    # Per depth: acceptance rate among the steps that reached the depth, vs alpha_i.
    reached = torch.cat([torch.ones(n, 1, dtype=torch.bool), result.accepted[:, :-1]], 1)
    for i in range(gamma):
        m = int(reached[:, i].sum())
        rate = result.accepted[:, i][reached[:, i]].double().mean()
        se = math.sqrt(float(alpha[i] * (1 - alpha[i])) / m)
        out[f'alpha_{i}_z'] = abs(float(rate - alpha[i])) / se
    # Emitted token at output position i (present iff N >= i) is distributed as p_i.
    for i in range(gamma + 1):
        present = result.tokens[:, i] >= 0
        tokens = result.tokens[present, i]
        counts = torch.bincount(tokens, minlength=p.shape[-1]).double()
        out[f'token_{i}_p'] = chi_square_p_value(counts, p[i])
        out[f'token_{i}_tv'] = 0.5 * float((counts / counts.sum() - p[i]).abs().sum())
        out[f'token_{i}_n'] = int(present.sum())
    return out


def assert_claim_holds(stats):
    failures = []
    for key, value in stats.items():
        if key.endswith('_p') and value < P_VALUE:
            failures.append(f'{key}={value:.3g} < {P_VALUE}')
        if key.endswith('_z') and value > Z_MAX:
            failures.append(f'{key}={value:.2f} standard errors > {Z_MAX}')
        if key.endswith('_tv'):
            n = stats[key[: -len('tv')] + 'n']
            bound = 3.0 * math.sqrt(V / n)  # a generous multiple of the typical sampling TV
            if value > bound:
                failures.append(f'{key}={value:.4f} > {bound:.4f}')
    assert not failures, 'speculative sampling claim violated: ' + '; '.join(failures)


# --------------------------------------------------------------------------------------------
# The verifier satisfies the claim.


@pytest.mark.parametrize('seed', [0, 1])
def test_acceptance_rate_and_output_distribution(seed):
    p, q = _distributions(seed)
    result = _run(verify, p, q, seed=10 + seed)
    stats = sampler_checks(result, p, q)
    assert_claim_holds(stats)
    # And the overall mean, the headline number, matches sum_j prod_{i<=j} alpha_i.
    alpha = acceptance_probability(p[:GAMMA], q)
    expected = float(expected_accepted_drafts(alpha))
    mean = result.num_accepted.double().mean()
    se = result.num_accepted.double().std() / math.sqrt(N)
    assert abs(float(mean) - expected) < Z_MAX * float(se), (float(mean), expected, float(se))


def test_single_draft_matches_sum_min():
    """gamma = 1, the textbook case: P(accept) = sum min(p, q); output ~ p."""
    p, q = _distributions(3, gamma=1)
    result = _run(verify, p, q, seed=7)
    alpha = float(acceptance_probability(p[0], q[0]))
    rate = result.num_accepted.double().mean()
    se = math.sqrt(alpha * (1 - alpha) / N)
    assert abs(float(rate) - alpha) < Z_MAX * se
    counts = torch.bincount(result.tokens[:, 0], minlength=V)
    assert chi_square_p_value(counts, p[0]) > P_VALUE


def test_rao_blackwell_estimate_is_unbiased_and_tighter():
    p, q = _distributions(4)
    result = _run(verify, p, q, n=50_000, seed=5)
    rb = rao_blackwell_accepted(result)
    raw = result.num_accepted.double()
    expected = float(expected_accepted_drafts(acceptance_probability(p[:GAMMA], q)))
    assert abs(float(rb.mean()) - expected) < Z_MAX * float(rb.std()) / math.sqrt(rb.numel())
    assert rb.std() < raw.std()


def test_identical_draft_always_accepted():
    p, _ = _distributions(2)
    q = p[:GAMMA].clone()
    result = _run(verify, p, q, n=20_000, seed=3)
    assert bool((result.num_accepted == GAMMA).all())
    assert torch.allclose(result.alpha, torch.ones_like(result.alpha))


def test_disjoint_draft_never_accepted():
    p = torch.zeros(GAMMA + 1, V, dtype=torch.float64)
    p[:, : V // 2] = 2.0 / V
    q = torch.zeros(GAMMA, V, dtype=torch.float64)
    q[:, V // 2 :] = 2.0 / V
    result = _run(verify, p, q, n=5_000, seed=3)
    assert bool((result.num_accepted == 0).all())
    assert bool((result.tokens[:, 0] < V // 2).all())  # the residual is p itself here


def test_seeded_runs_repeat_and_differ_by_seed():
    p, q = _distributions(0)
    a = _run(verify, p, q, n=1000, seed=1)
    b = _run(verify, p, q, n=1000, seed=1)
    c = _run(verify, p, q, n=1000, seed=2)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


def test_residual_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    r = residual_distribution(p, q)
    assert torch.allclose(r[0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(r[1], p[1])  # no residual mass: fall back to p


def test_bad_shapes_raise():
    p, q = _distributions(0)
    drafts = torch.zeros(2, GAMMA, dtype=torch.long)
    with pytest.raises(ValueError, match='target_probs'):
        verify(drafts, q.expand(2, *q.shape), p[:GAMMA].expand(2, GAMMA, V))
    with pytest.raises(ValueError, match='draft_probs'):
        verify(drafts, q[:1].expand(2, 1, V), p.expand(2, *p.shape))
    with pytest.raises(ValueError, match='outside'):
        verify(drafts + V, q.expand(2, *q.shape), p.expand(2, *p.shape))


# --------------------------------------------------------------------------------------------
# The same checks reject wrong verifiers (so a pass above means something).


def _accept_always(drafts, q, p, generator):
    """Wrong: every draft is accepted (tokens follow q, not p)."""
    n, gamma = drafts.shape
    tokens = torch.cat([drafts, speculative.sample(p[:, gamma], generator).unsqueeze(1)], 1)
    return VerifyResult(
        num_accepted=torch.full((n,), gamma, dtype=torch.long),
        tokens=tokens,
        accepted=torch.ones(n, gamma, dtype=torch.bool),
        alpha=acceptance_probability(p[:, :gamma], q),
    )


def _bonus_from_last_draft_position(drafts, q, p, generator):
    """Wrong: the bonus token is drawn from p_gamma instead of p_{gamma+1} (an off-by-one)."""
    shifted = torch.cat([p[:, :-1], p[:, -2:-1]], dim=1)
    return verify(drafts, q, shifted, generator)


@pytest.mark.parametrize(
    'broken',
    ['accept_always', 'residual_is_p', 'residual_is_q', 'bonus_off_by_one'],
)
def test_checks_reject_a_wrong_verifier(broken, monkeypatch):
    p, q = _distributions(0)
    verifier = verify
    if broken == 'accept_always':
        verifier = _accept_always
    elif broken == 'residual_is_p':
        monkeypatch.setattr(speculative, 'residual_distribution', lambda p_, q_: p_)
    elif broken == 'residual_is_q':
        monkeypatch.setattr(speculative, 'residual_distribution', lambda p_, q_: q_)
    elif broken == 'bonus_off_by_one':
        verifier = _bonus_from_last_draft_position
    result = _run(verifier, p, q, seed=10)
    with pytest.raises(AssertionError, match='claim violated'):
        assert_claim_holds(sampler_checks(result, p, q))


# --------------------------------------------------------------------------------------------
# Greedy verification (T = 0) and sampling at a temperature.


def test_greedy_accepts_the_agreeing_prefix_and_emits_the_main_models_greedy_decoding():
    g = torch.Generator().manual_seed(0)
    batch = 4000
    logits = torch.randn(batch, GAMMA + 1, V, generator=g, dtype=torch.float64)
    greedy = logits.argmax(-1)
    # Drafts that agree with the main model's argmax with probability 1/2 at each depth.
    wrong = (greedy[:, :GAMMA] + torch.randint(1, V, (batch, GAMMA), generator=g)) % V
    agree = torch.rand(batch, GAMMA, generator=g) < 0.5
    drafts = torch.where(agree, greedy[:, :GAMMA], wrong)
    result = verify_greedy(drafts, logits)
    expected = agree.long().cumprod(-1)
    assert torch.equal(result.accepted, expected.bool())
    assert torch.equal(result.num_accepted, expected.sum(-1))
    assert torch.equal(result.alpha, agree.double())
    assert torch.equal(rao_blackwell_accepted(result), expected.sum(-1).double())
    for b in range(batch):  # the emitted tokens are the main model's greedy tokens, then padding
        k = int(result.num_accepted[b])
        assert result.tokens[b, : k + 1].tolist() == greedy[b, : k + 1].tolist()
        assert (result.tokens[b, k + 1 :] == -1).all()
    counts = torch.bincount(result.num_accepted, minlength=GAMMA + 1)
    assert counts.tolist()[0] > 0 and counts.tolist()[GAMMA] > 0


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.zeros(1, 2, V)
    logits[0, 0, [2, 5]] = 1.0  # tie between 2 and 5
    assert verify_greedy(torch.tensor([[2]]), logits).num_accepted.item() == 1
    assert verify_greedy(torch.tensor([[5]]), logits).num_accepted.item() == 0
    assert verify_greedy(torch.tensor([[5]]), logits).tokens.tolist() == [[2, -1]]


def test_greedy_bad_shapes_raise():
    with pytest.raises(ValueError, match='target_logits'):
        verify_greedy(torch.zeros(2, GAMMA, dtype=torch.long), torch.zeros(2, GAMMA, V))
    with pytest.raises(ValueError, match='outside'):
        verify_greedy(torch.full((2, GAMMA), V), torch.zeros(2, GAMMA + 1, V))


def test_verifier_at_a_temperature_accepts_with_sum_min_of_the_tempered_distributions():
    """At T = 0.7, drafts sampled from q_T and verified against p_T: acceptance sum min(p_T, q_T),
    output distributed as p_T, i.e. exactly the claim at T = 1 for the tempered distributions."""
    g = torch.Generator().manual_seed(5)
    zp = torch.randn(GAMMA + 1, V, generator=g, dtype=torch.float64)
    zq = torch.randn(GAMMA, V, generator=g, dtype=torch.float64)
    p, q = probabilities(zp, 0.7), probabilities(zq, 0.7)
    assert torch.allclose(p, torch.softmax(zp / 0.7, -1))
    assert not torch.allclose(acceptance_probability(p[:GAMMA], q),
                              acceptance_probability(torch.softmax(zp[:GAMMA], -1),
                                                     torch.softmax(zq, -1)))
    assert_claim_holds(sampler_checks(_run(verify, p, q, seed=21), p, q))


@pytest.mark.parametrize('temperature', [0.0, -1.0, float('nan'), float('inf')])
def test_probabilities_rejects_a_bad_temperature(temperature):
    with pytest.raises(ValueError, match='temperature'):
        probabilities(torch.zeros(3), temperature)
