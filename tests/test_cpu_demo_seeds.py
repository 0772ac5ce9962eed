"""examples/cpu_demo_seeds.py: the toy's rate grid and seeds, its evidence rule, resuming.

The rule is checked against a recomputation from the run records with the standard library's
``statistics`` (not the code under test); the grid's edge extension against a fake demo.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'examples' / 'cpu_demo_seeds.py'
sys.path.insert(0, str(ROOT / 'examples'))

from test_cpu_demo import TINY  # noqa: E402

ARMS = ['ce', 'tv', 'cold_ce', 'cold_kl']


def run_seeds(*args):
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_runs_every_seed_applies_the_rule_and_resumes(tmp_path):
    results, out = tmp_path / 'results', tmp_path / 'out'
    args = ['--seeds', '1,2', '--lr-factors', '1', '--results-dir', str(results),
            '--out-dir', str(out), '--', *TINY, '--arms', ','.join(ARMS)]
    res = run_seeds(*args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [line for line in res.stderr.splitlines() if line.startswith('run:')] == [
        f'run: seed {s}, rates x1, arms {",".join(ARMS)}' for s in (0, 1, 2)]
    records = {}
    for seed in (1, 2):
        path = results / 'runs' / f'seed{seed}_x1_{"-".join(ARMS)}.json'
        records[seed] = json.loads(path.read_text())
        assert records[seed]['settings']['seed'] == seed
        assert records[seed]['settings']['arms'] == ARMS
    summary = json.loads((results / 'summary.json').read_text())
    assert summary['seeds'] == [1, 2] and summary['chosen_factor'] == dict.fromkeys(ARMS, 1.0)
    # no serve_* arm: the demo verifies at the serving temperature only beside one
    assert set(summary['tables']) == {'warm T=1', 'warm greedy', 'cold T=1', 'cold greedy'}
    mode_key = {'T=1': 'T=1', 'greedy': 'greedy'}
    for table, arm, ref in (('warm T=1', 'tv', 'ce'), ('cold greedy', 'cold_kl', 'cold_tv'),
                            ('cold greedy', 'cold_kl', 'cold_ce')):
        mode = mode_key[table.split()[1]]
        row = next(r for r in summary['tables'][table] if r['arm'] == arm)
        if ref not in ARMS:
            assert f'vs {ref}' not in row
            continue
        got = row[f'vs {ref}']
        per_seed = [statistics.fmean(a - b for a, b in zip(records[s]['accepted'][arm][mode],
                                                             records[s]['accepted'][ref][mode]))
                    for s in (1, 2)]
        assert got['per_seed'] == pytest.approx(per_seed)
        assert got['mean'] == pytest.approx(statistics.fmean(per_seed))
        assert got['se_seeds'] == pytest.approx(statistics.stdev(per_seed) / math.sqrt(2))
        one_sign = all(d > 0 for d in per_seed) or all(d < 0 for d in per_seed)
        beyond = abs(got['mean']) > 2 * got['se_seeds'] and abs(got['mean']) > 2 * got['se_units']
        assert got['resolved'] == (one_sign and beyond)
    assert (results / 'report.md').read_text().strip() in res.stdout
    assert (results / 'gains.png').stat().st_size > 10_000

    rerun = run_seeds(*args)  # every run's record exists: nothing runs again
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert 'run:' not in rerun.stderr
    assert json.loads((results / 'summary.json').read_text())['tables'] == summary['tables']


def test_a_rate_that_wins_at_an_edge_is_extended():
    """The arm whose score keeps rising with the rate is tried a half-decade past the grid's top
    (and only that arm); the arm that peaks inside the grid is not."""
    import cpu_demo_seeds as S

    calls = []

    class FakeRuns:
        def get(self, seed, factor, arms):
            calls.append((seed, factor, list(arms)))
            score = {'rising': factor, 'inner': -abs(math.log(factor))}
            return {'accepted': {arm: {'T=1': [score[arm]] * 4} for arm in arms}}

    chosen, scores = S.select_rates(FakeRuns(), 0, ['rising', 'inner'], [0.3, 1.0, 3.0], 1)
    assert calls[3:] == [(0, 9.49, ['rising'])]
    assert chosen == {'rising': 9.49, 'inner': 1.0}
    assert sorted(scores['rising']) == [0.3, 1.0, 3.0, 9.49]


@pytest.mark.parametrize('args, message', [
    (['--select-seed', '1', '--seeds', '1,2,3'], 'also in --seeds'),
    (['--seeds', '4'], 'at least two distinct seeds'),
    (['--lr-factors', '0,1'], 'positive factors'),
    (['--', '--seed', '3'], '--seed is set by this script'),
    (['--', '--cold-lr=1e-3'], '--cold-lr is set by this script'),
    (['--', '--arms', 'ce,nope'], "unknown ['nope']"),
])
def test_bad_settings_exit_with_a_clear_message(capsys, args, message):
    import cpu_demo_seeds as S

    with pytest.raises(SystemExit) as err:
        S.parse_args(args)
    assert err.value.code == 2 and message in capsys.readouterr().err
