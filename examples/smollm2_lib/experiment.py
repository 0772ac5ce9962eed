"""The SmolLM2 experiment: one protocol for every loss, its presets, and a store of its parts.

Everything trains on Python code (the standard library's sources, ``data.py``) at a constant
learning rate after a short warm-up, so one run gives every horizon. Scenarios, in the order
they run (a run cut short has the first ones):

* ``cold``: fresh one-depth MTP heads on the pretrained backbone, trained with ``'ce'`` and
  every loss of the registry whose one-depth objective is its own (``'e2e_tv'`` equals ``'tv'``
  at one depth). Every loss runs the same learning-rate grid on seed 0 at the full budget of
  ``cold_steps`` (``cold_{loss}_lr{lr}_n{steps}_s0``), extended by a half-decade while its best
  rate is at an edge; each arm reports its gain over the last quarter of the run (a plateau:
  under ``plateau_gain``). The best rate then runs the other seeds, and every seed's heads are
  scored on the test split (``test_cold_{loss}_s{seed}``). One loss is finished before the next
  starts, so that an interrupted run loses no heads a later part needs.
* ``drift`` (the seeds' scenario): the ``'ce'`` head of ``cold_ce_s0`` at its rate plays the
  *official* head, trained to plateau on the model it ships with. The backbone alone is then
  moved by SFT on another domain (English docs, ``pydoc``; ``drift_move``) until the official
  head's alpha on code, where it serves, has dropped by at least ``drift_target``; this part
  runs right after the ``'ce'`` cold arms, before the other losses', since it decides whether
  the scenario holds. ``drift_before`` / ``drift_after`` score the head on both backbones. The
  head, grafted onto the moved backbone, is healed with every loss: the same grid protocol
  (``heal_{loss}_lr{lr}_n{steps}_s{seed}``, ``test_heal_{loss}_s{seed}``).
* ``joint``: the same fine-tuning of the backbone with the official head attached and trained
  together with it (``mtp_detach_heads=False``, Megatron's MTP loss scale), every loss, for
  ``joint_seeds`` (``joint_{loss}_s{seed}``): acceptance, and the main model's held-out loss
  against the fine-tuning without heads.

Every part writes ``<results>/parts/<name>.json`` when it finishes (``--commit`` also commits
it); a rerun loads the parts whose settings fingerprint matches and runs only the rest. A heads
arm saves its heads and optimiser state every ``checkpoint_every`` steps in the cache folder, so
an interrupted arm resumes mid-run and a finished one can be extended to a larger budget;
weights a later part needs (an arm's final heads, the moved backbone) are kept there too, and
retrained from their part's settings where a fresh machine lacks them.
"""

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from cpu_demo_lib.report import commit_files

#: Bumped when a change to the code changes what a part computes: old parts are then rerun.
EXPERIMENT_VERSION = 2


@dataclass(frozen=True)
class Preset:
    """Sizes of one run. Steps are optimiser steps of ``batch`` training windows."""

    name: str
    scenarios: Tuple[str, ...]
    seeds: Tuple[int, ...]
    """Seeds of every headline arm; the learning-rate grid runs on the first."""
    batch: int = 2
    block: int = 513
    """Tokens per data block: a training window (``block - 1`` tokens) and its labels; an
    evaluation window is the first ``2 * context`` tokens of a block."""
    stdlib_chars: Optional[int] = 2_500_000
    warmup: int = 20
    """Steps of linear warm-up, then a constant learning rate."""
    lr_grid: Tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    lr_extensions: int = 2
    """Half-decades the grid may grow past a winning edge, per loss."""
    cold_steps: int = 600
    plateau_gain: float = 0.02
    eval_every: int = 50
    curve_windows: int = 32
    """Validation windows of the curves (every ``eval_every`` steps); the whole validation
    split scores each arm at its last step."""
    validation_windows: Optional[int] = None
    """The validation windows an arm's rate is chosen on (spread evenly over the split, so
    over its files; None: the whole split)."""
    checkpoint_every: int = 50
    heal_lr_grid: Tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    heal_steps: int = 200
    heal_eval_every: int = 25
    drift_lrs: Tuple[float, ...] = (1e-3, 3e-3)
    """Rates of the backbone's fine-tuning on English docs, tried in turn: the first that lowers
    the official head's alpha by ``drift_target`` within ``drift_max_steps`` moves it (what
    slower rates and the model's own samples did: docs/smollm2_demo.md, Protocol)."""
    drift_check_every: int = 25
    drift_max_steps: int = 300
    drift_target: float = 0.05
    joint_seeds: Tuple[int, ...] = (0, 1)
    joint_mtp_scale: float = 0.1
    lk_eta: float = 3.0
    serving_temperature: float = 0.7
    context: int = 256
    """Scored positions have at least this many tokens of context; prompts are this long."""
    tf_windows: int = 96
    spec_prompts: int = 96
    spec_rounds: int = 12
    continuation_prompts: int = 62
    threads: int = 2
    losses: Optional[Tuple[str, ...]] = None
    """The losses every scenario runs (None: :func:`depth_one_losses`, or
    :func:`chained_losses` at more than one depth)."""
    depths: int = 1
    """MTP depths of every head, and the drafts per verify step (gamma) it is scored with."""
    repeated_layer: bool = False
    """One MTP layer applied at every depth (``mtp_use_repeated_layer``)."""
    schedule: str = 'constant'
    """After the warm-up: ``'constant'``, or ``'cosine'`` decay to zero at an arm's last step."""
    split: str = 'blocks'
    """How the code is split: ``'blocks'`` (interleaved blocks) or ``'files'``
    (:func:`~smollm2_lib.data.load_files_domain`)."""
    plateau_check: bool = False
    """Each loss's best rate also runs on the first seed at twice the budget: the head is at
    its plateau if that gains under ``plateau_gain`` (relative, in tokens per verify step);
    otherwise the budget doubles, up to ``max_doublings`` times, and the seeds run at the first
    budget whose double gains under it (:meth:`Experiment.plateau_budget`)."""
    max_doublings: int = 3

    def loss_names(self) -> List[str]:
        if self.losses is not None:
            return list(self.losses)
        return chained_losses() if self.depths > 1 else depth_one_losses()

    def common(self) -> Dict:
        """The settings every part of a run shares (data, protocol, evaluation): a part stored
        under other values of these is not reused. What one part trains (its loss, learning
        rate, seed, steps, what it starts from) is that part's own key."""
        keys = ('block', 'batch', 'stdlib_chars', 'warmup', 'eval_every', 'curve_windows',
                'context', 'tf_windows', 'spec_prompts', 'spec_rounds', 'continuation_prompts',
                'serving_temperature', 'lk_eta')
        out = {'version': EXPERIMENT_VERSION, **{k: getattr(self, k) for k in keys}}
        # Settings added after the 'long' run: recorded where they differ from the default, so
        # that its stored parts keep their fingerprints.
        for name in ('depths', 'repeated_layer', 'schedule', 'split', 'validation_windows'):
            if getattr(self, name) != Preset.__dataclass_fields__[name].default:
                out[name] = getattr(self, name)
        return out


def chained_losses() -> List[str]:
    """``'ce'`` and every loss of the registry (``'e2e_tv'`` included: its objective differs
    from ``'tv'`` over chained drafts)."""
    from megatron.mtp_tv.losses import LOSSES

    return ['ce', *LOSSES]


def depth_one_losses() -> List[str]:
    """``'ce'`` and the registry's losses whose objective is per depth (``per_chain`` losses
    equal a per-depth one at one depth)."""
    from megatron.mtp_tv.losses import LOSSES

    return ['ce'] + [name for name, cls in LOSSES.items() if not cls.per_chain]


PRESETS: Dict[str, Preset] = {
    'long': Preset(name='long', scenarios=('cold', 'drift', 'joint'), seeds=(0, 1, 2)),
    # The method end to end within 30 minutes (measured: docs/smollm2_demo.md, Presets): the cold
    # start alone, one seed, one learning rate for every loss, a short budget, a smaller slice of
    # the same code and the same evaluation at smaller sizes. A demonstration, not a ranking.
    # Issue 59's protocol: chained drafts as served (one shared MTP layer applied at three
    # depths, gamma = 3), heads at their plateau (a decaying schedule; twice the budget gains
    # under 2%), evaluation files disjoint from training files. Its first part is the official
    # head: 'ce' on the backbone it ships with, on the rate grid, at N and 2N.
    'chained': Preset(name='chained', scenarios=('official',), seeds=(0, 1, 2), depths=3,
                      repeated_layer=True, schedule='cosine', split='files', plateau_check=True,
                      stdlib_chars=None, cold_steps=800, eval_every=100, checkpoint_every=50,
                      validation_windows=128, tf_windows=96, spec_prompts=80,
                      continuation_prompts=80),
    # The chained preset's code paths at toy sizes (tests/test_smollm2.py).
    'chained-smoke': Preset(name='chained-smoke', scenarios=('official',), seeds=(0, 1),
                            depths=2, repeated_layer=True, schedule='cosine', split='files',
                            plateau_check=True, max_doublings=1, block=33, losses=('ce',),
                            stdlib_chars=60_000, warmup=1, lr_grid=(1e-3, 3e-3),
                            lr_extensions=0, cold_steps=3,
                            eval_every=2, curve_windows=2, checkpoint_every=2, context=8,
                            tf_windows=2, spec_prompts=3, spec_rounds=2, continuation_prompts=2,
                            batch=1, threads=1),
    'default': Preset(name='default', scenarios=('cold',), seeds=(0,), stdlib_chars=700_000,
                      lr_grid=(1e-3,), cold_steps=60, eval_every=20, curve_windows=16,
                      tf_windows=24, spec_prompts=32, continuation_prompts=8),
    # The code paths of the long preset at toy sizes (tests/test_smollm2.py), on one thread: the
    # test runs beside another pytest-xdist worker, where two threads wait on each other in
    # OpenMP's barriers. Three losses: the baseline, a loss against the main model and the
    # cold-start one; every scenario's code is the same for each loss, and the losses are tested
    # on their own. A grid of two rates, not extended (best_lr's extension has its own test).
    'smoke': Preset(name='smoke', scenarios=('cold', 'drift', 'joint'), seeds=(0,), block=33,
                    losses=('ce', 'tv', 'nla'), stdlib_chars=25_000, warmup=1, lr_grid=(1e-3, 3e-3), lr_extensions=0,
                    cold_steps=4, eval_every=2, curve_windows=2, checkpoint_every=2,
                    heal_lr_grid=(1e-3,), heal_steps=2, heal_eval_every=1, drift_lrs=(1e-3,),
                    drift_check_every=1, drift_max_steps=2, drift_target=1.0, joint_seeds=(0,),
                    context=8,
                    tf_windows=2, spec_prompts=3, spec_rounds=2, continuation_prompts=2,
                    batch=1, threads=1),
}


def part_name(kind: str, loss: str, seed: int) -> str:
    """A per-loss, per-seed part's name: ``kind`` is ``'test_cold'``, ``'test_heal'`` or
    ``'joint'``."""
    return f'{kind}_{loss}_s{seed}'


def fingerprint(settings: Dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class Store:
    """``<directory>/parts/<name>.json``: a part's record, its key (what it trained) and the
    fingerprint of the run's common settings and that key."""

    def __init__(self, directory: str, common: Dict, commit: bool = False):
        self.directory = os.path.abspath(directory)
        self.common = common
        self.commit = commit

    def fingerprint(self, key: Dict) -> str:
        return fingerprint({'common': self.common, 'key': key})

    def path(self, name: str) -> str:
        return os.path.join(self.directory, 'parts', f'{name}.json')

    def _read(self, name: str) -> Optional[Dict]:
        try:
            with open(self.path(name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def load(self, name: str, key: Dict) -> Optional[Dict]:
        """The stored part, if it was made from ``key`` under the same common settings."""
        record = self._read(name)
        return record if record and record.get('fingerprint') == self.fingerprint(key) else None

    def save(self, name: str, key: Dict, record: Dict) -> Dict:
        record = {'part': name, 'key': key, 'fingerprint': self.fingerprint(key),
                  'common': self.common, **record}
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + '.tmp', 'w') as f:
            json.dump(record, f, indent=1)
            f.write('\n')
        os.replace(path + '.tmp', path)  # a killed run never leaves half a part behind
        if self.commit:
            commit_files([path], f'smollm2 results: part {name}')
        return record

    def all(self) -> Dict[str, Dict]:
        """Every stored part made under the same common settings (for the report)."""
        folder = os.path.join(self.directory, 'parts')
        names = sorted(n[:-5] for n in os.listdir(folder) if n.endswith('.json')) \
            if os.path.isdir(folder) else []
        records = {n: self._read(n) for n in names}
        return {n: r for n, r in records.items() if r.get('common') == self.common}


def spread(blocks: torch.Tensor, count: Optional[int]) -> torch.Tensor:
    """``count`` of ``blocks`` ``[n, ...]`` at evenly spaced indices (all if None or >= n)."""
    n = blocks.shape[0]
    if count is None or count >= n:
        return blocks
    return blocks[torch.linspace(0, n - 1, count).round().long()]


def half_decade(lr: float, up: bool) -> float:
    """The next value on the 1-3-10 ladder above or below ``lr`` (1e-3 -> 3e-3 or 3e-4)."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10 ** exponent)
    ladder = [(m, e) for e in (exponent - 1, exponent, exponent + 1) for m in (1, 3)]
    i = ladder.index((mantissa, exponent))
    m, e = ladder[i + 1 if up else i - 1]
    return float(f'{m}e{e}')


def eval_points(steps: int, every: int) -> List[int]:
    """The curve's evaluation steps: every ``every`` steps and the last."""
    return sorted(set(range(every, steps + 1, every)) | {steps})


def point_at(curve: List[Dict], step: float) -> Dict:
    """The curve point nearest ``step``."""
    return min(curve, key=lambda p: abs(p['step'] - step))


def tau_gain(short: Dict, long: Dict) -> float:
    """Relative gain in validation tau (``1 +`` accepted drafts, T=1) from arm record ``short``
    to ``long`` (the same arm at twice the budget)."""
    before, after = (1 + r['validation']['sampled']['accepted'] for r in (short, long))
    return (after - before) / before


def plateau_gain(curve: List[Dict], steps: int) -> float:
    """Relative gain of validation accepted drafts (T=1) over the last quarter of ``steps``."""
    end = point_at(curve, steps)['sampled']['accepted']
    start = point_at(curve, 0.75 * steps)['sampled']['accepted']
    return (end - start) / abs(start) if start else float('inf')


def window_order(count: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """``[steps, batch]`` indices of training windows: seeded permutations, epoch after epoch.
    A prefix of a longer order is the shorter one (an extended arm sees the same windows)."""
    generator = torch.Generator().manual_seed(seed)
    need = steps * batch
    order = torch.cat([torch.randperm(count, generator=generator)
                       for _ in range(math.ceil(need / count))])
    return order[:need].view(steps, batch)


def set_lr(optimizer, lr: float, step: int, warmup: int, total: Optional[int] = None,
           schedule: str = 'constant') -> None:
    """The rate of ``step`` (1-based): a linear warm-up over ``warmup`` steps, then ``lr``
    (``'constant'``) or a cosine decay from ``lr`` to zero at step ``total`` (``'cosine'``).
    Set from the step alone, so a resumed run continues the same schedule."""
    rate = lr * min(1.0, step / warmup)
    if schedule == 'cosine' and step > warmup:
        rate = lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    elif schedule not in ('constant', 'cosine'):
        raise ValueError(f"schedule={schedule!r}; expected 'constant' or 'cosine'")
    for group in optimizer.param_groups:
        group['lr'] = rate


def make_optimizer(params, lr: float):
    """AdamW (betas 0.9/0.95, no weight decay); no gradient clipping anywhere: from a cold start
    the losses' gradient norms differ 100-fold, and Adam without clipping is invariant to the
    scale, where clipping would clip some arms and not others."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass
class EvalSets:
    """What every arm on one backbone is evaluated on (built on first use, then kept)."""

    validation: Optional[object] = None
    curve: Optional[object] = None
    tf_test: Optional[object] = None
    tf_continuation: Optional[object] = None
    prompts: Optional[object] = None
    train_states: Dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class HeadsArm:
    """One heads-only training run on a frozen backbone."""

    scenario: str
    """``'cold'`` (fresh heads on the original backbone) or ``'heal'`` (the official head on the
    moved one)."""
    loss: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f'{self.scenario}_{self.loss}_lr{self.lr:g}_n{self.steps}_s{self.seed}'


class Experiment:
    """Runs the parts of ``preset`` that ``store`` lacks."""

    def __init__(self, preset: Preset, store: Store, cache_dir: Optional[str],
                 log: Callable[[str], None] = print):
        """``cache_dir``: the converted checkpoint's folder (``weights.load_hf``; None: its
        default, '' none); checkpoints and weights later parts need go to ``<it>/runs/``."""
        self.preset, self.store, self.log = preset, store, log
        from smollm2_lib.weights import default_cache_dir

        self.cache_dir = cache_dir
        root = default_cache_dir() if cache_dir is None else cache_dir
        self.runs_dir = os.path.join(root, 'runs') if root else None
        self.records: Dict[str, Dict] = {}
        self.kept: Dict[str, Dict] = {}
        self.models: Dict[Tuple, object] = {}
        self.fresh: Dict[int, Dict] = {}
        self.sets: Dict[str, EvalSets] = {}
        self.backbones: Dict[str, Dict] = {}
        self.budgets: Dict[Tuple[str, str], int] = {}
        """Each ``(scenario, loss)``'s budget: ``cold_steps`` or its plateau budget."""

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        from smollm2_lib import data as DATA
        from smollm2_lib import weights as W

        p = self.preset
        hf_model, tokenizer = W.load_hf(self.cache_dir)
        self.hf_config = hf_model.config
        if 2 * p.context > p.block - 1:
            raise ValueError(f'context {p.context}: evaluation windows of {2 * p.context} tokens '
                             f'do not fit blocks of {p.block}')
        if p.split == 'files':
            self.code = DATA.load_files_domain(tokenizer, p.block, p.stdlib_chars)
        else:
            self.code = DATA.load_domain('code', 'stdlib', tokenizer, p.stdlib_chars, p.block)
        if {'drift', 'joint'} & set(p.scenarios):  # the data that moves the backbone
            self.docs = DATA.load_domain('docs', 'pydoc', tokenizer, None, p.block)
        self.roles = DATA.test_roles(self.code, p.tf_windows, p.spec_prompts,
                                     p.continuation_prompts)
        if p.curve_windows > self.code.validation.shape[0]:
            raise ValueError(f'curve_windows {p.curve_windows}: the validation split has '
                             f'{self.code.validation.shape[0]} blocks')
        model = self.build(None, 'ce')
        W.load_backbone(model, hf_model)
        self.backbones['original'] = self.backbone_of(model)
        del hf_model

    def build(self, depths: Optional[int], loss: str, joint: bool = False, seed: int = 0,
              backbone: Optional[Dict] = None, heads: Optional[Dict] = None):
        """A GPTModel with ``depths`` MTP depths (None: none) trained with ``loss``; heads-only
        (``mtp_detach_heads``, scale 1) unless ``joint``; the given backbone and heads, else
        fresh heads (Megatron's initialisation seeded by ``seed``).

        One model per depth count (and joint or not) is built and then reloaded, its
        ``mtp_loss_type`` set (building initialises 135M parameters, and memory holds a few
        models, not one per loss): a later call returns the same object, so an arm builds its
        model after its evaluation sets (built on a model without heads).
        Megatron's MTP tracker is emptied, since its size is the depth count."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        from smollm2_lib import weights as W

        def make(build_seed):
            overrides = {} if depths is None else dict(
                mtp_loss_type=loss, mtp_detach_heads=not joint,
                mtp_loss_scaling_factor=self.preset.joint_mtp_scale if joint else 1.0,
                mtp_lk_eta=self.preset.lk_eta,
                mtp_use_repeated_layer=self.preset.repeated_layer)
            return W.build_megatron(self.hf_config, depths, self.preset.block - 1,
                                    seed=build_seed * 1000 + 5, **overrides)

        key = (depths, joint)
        if key not in self.models:
            self.models[key] = make(seed)
            if depths is not None:
                self.fresh.setdefault(seed, self.heads_of(self.models[key]))
        model = self.models[key]
        if depths is not None:
            model.config.mtp_loss_type = loss  # read (and validated) by every MTP loss call
            if heads is None:
                if seed not in self.fresh:
                    self.fresh[seed] = self.heads_of(make(seed))
                heads = self.fresh[seed]
        model.load_state_dict({**model.state_dict(), **(backbone or {}), **(heads or {})})
        MTPLossLoggingHelper.tracker.clear()
        return model

    @staticmethod
    def heads_of(model) -> Dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if k.startswith('mtp.') and torch.is_tensor(v)}

    @staticmethod
    def backbone_of(model) -> Dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if not k.startswith('mtp.') and torch.is_tensor(v)}

    # ------------------------------------------------------------------ evaluation sets

    def eval_sets(self, backbone: str, need: Tuple[str, ...]) -> EvalSets:
        """Evaluation sets of one backbone on code, built on first use and kept. The roles are
        disjoint blocks: the validation split (curves on its first ``curve_windows`` windows,
        the whole split at an arm's end), and in the test split the teacher-forced windows, the
        speculative-decoding prompts and the prompts the main model continues."""
        from smollm2_lib import evaluate as E
        from smollm2_lib import heads as H

        p = self.preset
        sets = self.sets.setdefault(backbone, EvalSets())
        missing = [n for n in need if getattr(sets, n) is None]
        if not missing:
            return sets
        model = self.build(None, 'ce', backbone=self.backbones[backbone])  # states and logits
        window = p.context * 2
        label = f'{backbone} backbone'
        for name in missing:
            if name in ('validation', 'curve'):
                if sets.validation is None:
                    windows = spread(self.code.validation, p.validation_windows)[:, :window]
                    states = H.cache_states(model, windows, 4, f'{label}: validation windows')
                    sets.validation = E.TeacherForcedSet.build('validation', model, windows,
                                                               states, p.context)
                n = p.curve_windows
                sets.curve = E.TeacherForcedSet('curve', sets.validation.windows[:n],
                                                sets.validation.states[:, :n], p.context)
            elif name == 'tf_test':
                windows = self.roles['tf'][:, :window]
                states = H.cache_states(model, windows, 4, f'{label}: test windows')
                sets.tf_test = E.TeacherForcedSet.build('test', model, windows, states, p.context)
            elif name == 'tf_continuation':
                # test blocks' openings, continued by this backbone itself at T=1
                windows = E.generate(model, self.roles['continuation'][:, : p.context],
                                     p.context, 1.0, seed=17)
                states = H.cache_states(model, windows, 4, f'{label}: sampled continuations')
                sets.tf_continuation = E.TeacherForcedSet.build('continuation', model, windows,
                                                                states, p.context)
            elif name == 'prompts':
                gamma = p.depths  # room that speculative_decoding needs
                capacity = p.context + p.spec_rounds * (gamma + 1) + 2 * gamma + 2
                sets.prompts = E.Prompts.prefill(model, self.roles['spec'][:, : p.context],
                                                 capacity)
        return sets

    def release(self, backbone: str) -> None:
        """Free a backbone's evaluation sets and training states (a few GB)."""
        self.sets.pop(backbone, None)

    def train_states(self, backbone: str, windows: torch.Tensor,
                     indices: torch.Tensor) -> Dict[int, torch.Tensor]:
        """The backbone's states ``[block - 1, 1, h]`` of the training windows ``indices`` of
        ``windows``, computed once per backbone and kept on disk in the cache folder (a
        resumed run does not recompute them)."""
        from smollm2_lib import heads as H

        sets = self.sets.setdefault(backbone, EvalSets())
        todo = sorted({int(i) for i in indices.flatten()} - set(sets.train_states))
        path = self._runs_path(f'states-{backbone}-{self.backbone_fingerprint(backbone)}.pt')
        if todo and path and os.path.exists(path):
            sets.train_states.update(torch.load(path))
            todo = [i for i in todo if i not in sets.train_states]
        if todo:
            model = self.build(None, 'ce', backbone=self.backbones[backbone])
            states = H.cache_states(model, windows[todo, :-1], 4,
                                    f'{backbone} backbone: training windows')
            for j, i in enumerate(todo):
                sets.train_states[i] = states[:, j : j + 1].clone()
            if path:
                self._save(path, sets.train_states)
        return sets.train_states

    def backbone_fingerprint(self, backbone: str) -> str:
        """What made ``backbone``: the original checkpoint, or the drift's fine-tuning."""
        return self.store.fingerprint(self.drift_key() if backbone == 'moved' else
                                      {'backbone': backbone})

    # ------------------------------------------------------------------ storage

    def _runs_path(self, name: str) -> Optional[str]:
        return os.path.join(self.runs_dir, name) if self.runs_dir else None

    @staticmethod
    def _save(path: str, obj) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, path + '.tmp')
        os.replace(path + '.tmp', path)

    def part(self, name: str, key: Dict, run: Callable[[], Dict]) -> Dict:
        """Load part ``name`` made from ``key``, or run it and store it."""
        record = self.store.load(name, key)
        if record is None:
            self.log(f'part {name}: running')
            t0, cpu0 = time.monotonic(), time.process_time()
            record = run()
            record['wall_s'] = time.monotonic() - t0
            record['cpu_s'] = time.process_time() - cpu0
            record['load_average'] = list(os.getloadavg())
            record = self.store.save(name, key, record)
            self.log(f'part {name}: done in {record["wall_s"]:.0f} s')
        self.records[name] = record
        return record

    def kept_weights(self, key: Dict, remake: Callable[[], Dict]) -> Dict:
        """Weights kept for ``key``: in memory, in the cache folder, else ``remake()`` (kept)."""
        fp = self.store.fingerprint(key)
        if fp not in self.kept:
            path = self._runs_path(f'weights-{fp}.pt')
            if path and os.path.exists(path):
                self.kept[fp] = torch.load(path)
            else:
                self.log(f'weights of {key}: not in the cache folder; making them')
                self.kept[fp] = remake()
                if path:
                    self._save(path, self.kept[fp])
        return self.kept[fp]

    # ------------------------------------------------------------------ heads-only arms

    def arm_key(self, arm: HeadsArm) -> Dict:
        start = ({'heads': 'fresh', 'backbone': 'original'} if arm.scenario == 'cold' else
                 {'heads': self.official_key(), 'backbone': self.drift_key()})
        return {**start, 'loss': arm.loss, 'lr': arm.lr, 'seed': arm.seed, 'steps': arm.steps}

    def _start(self, arm: HeadsArm) -> Tuple[str, Optional[Dict]]:
        """``(backbone, heads)`` the arm starts from (None: fresh heads of its seed)."""
        return ('original', None) if arm.scenario == 'cold' else ('moved', self.official())

    def run_arm(self, arm: HeadsArm) -> Tuple[Dict, Dict]:
        """Train ``arm`` from its latest checkpoint (or from the start): ``(record, heads)``.

        The record holds the curve (the first ``curve_windows`` validation windows every
        ``eval_every`` steps), the per-step MTP loss and gradient norm, and the whole
        validation split's score at the last step."""
        from smollm2_lib import heads as H

        p = self.preset
        backbone, heads = self._start(arm)
        every = p.heal_eval_every if arm.scenario == 'heal' else p.eval_every
        sets = self.eval_sets(backbone, ('validation', 'curve'))
        windows = self.code.train
        order = window_order(windows.shape[0], arm.steps, p.batch, arm.seed)
        states = self.train_states(backbone, windows, order)
        model = self.build(p.depths, arm.loss, seed=arm.seed, backbone=self.backbones[backbone],
                           heads=heads)
        params = H.freeze_backbone(model)
        optimizer = make_optimizer(params, arm.lr)
        curve = {'step': [], 'mtp_loss': [], 'grad_norm': [], 'validation': []}
        # At a constant rate a longer arm extends a shorter one; a decaying schedule does not.
        ckpt_key = {**self.arm_key(arm), 'steps': None if p.schedule == 'constant' else arm.steps}
        ckpt_path = self._runs_path(f'arm-{self.store.fingerprint(ckpt_key)}.pt')
        done = 0
        if ckpt_path and os.path.exists(ckpt_path):
            ckpt = torch.load(ckpt_path)
            if ckpt['step'] <= arm.steps:
                done, curve = ckpt['step'], ckpt['curve']
                model.load_state_dict({**model.state_dict(), **ckpt['heads']})
                optimizer.load_state_dict(ckpt['optimizer'])
                self.log(f'{arm.name}: resumed at step {done}')
        if done == 0:
            curve['validation'].append({'step': 0, **self.validation_summary(model, sets.curve)})
        points = set(eval_points(arm.steps, every))
        for step in range(done + 1, arm.steps + 1):
            rows = order[step - 1]
            blocks = windows[rows]
            main = torch.cat([states[int(i)] for i in rows], dim=1)
            set_lr(optimizer, arm.lr, step, p.warmup, arm.steps, p.schedule)
            stats = H.train_step(model, optimizer, blocks[:, :-1], blocks[:, 1:], main, None)
            curve['step'].append(step)
            curve['mtp_loss'].append(stats['mtp_loss'])
            curve['grad_norm'].append(stats['grad_norm'])
            if step in points:
                curve['validation'].append({'step': step, **self.validation_summary(
                    model, sets.curve)})
            if ckpt_path and (step % p.checkpoint_every == 0 or step == arm.steps):
                self._save(ckpt_path, {'step': step, 'curve': curve, 'heads': self.heads_of(model),
                                       'optimizer': optimizer.state_dict()})
        record = {'scenario': arm.scenario, 'loss': arm.loss, 'lr': arm.lr, 'seed': arm.seed,
                  'steps': arm.steps, 'depths': p.depths, 'curve': curve,
                  'validation': self.validation_summary(model, sets.validation),
                  'plateau_gain': plateau_gain(curve['validation'], arm.steps)}
        return record, self.heads_of(model)

    def arm(self, arm: HeadsArm) -> Dict:
        """Part ``arm.name``; its final heads are kept for the test part."""
        key = self.arm_key(arm)

        def run():
            record, heads = self.run_arm(arm)
            self.kept[self.store.fingerprint(key)] = heads
            path = self._runs_path(f'weights-{self.store.fingerprint(key)}.pt')
            if path:
                self._save(path, heads)
            return record

        return self.part(arm.name, key, run)

    def log_replay(self, name: str, measure: str, now: float, stored: float) -> None:
        """Log weights remade for part ``name`` beside the stored part, by ``measure``."""
        self.log(f'{name}: replayed, {measure} {now:.6f} (the stored part: {stored:.6f}, '
                 f'difference {now - stored:+.2e})')

    def heads(self, arm: HeadsArm) -> Dict:
        """The arm's final heads: kept, else retrained (a new machine has no cache folder).

        A retrained arm replays the stored one (same seed, data order and rate); the log puts
        their whole-validation scores side by side, so a replay that did not reproduce the
        stored part (another CPU's kernels, say) is seen before anything is built on it."""
        key = self.arm_key(arm)

        def retrain() -> Dict:
            record, heads = self.run_arm(arm)
            stored = self.store.load(arm.name, key)
            if stored is not None:
                self.log_replay(arm.name, 'whole-validation accepted drafts',
                                *(r['validation']['sampled']['accepted'] for r in (record, stored)))
            return heads

        return self.kept_weights(key, retrain)

    def best_lr(self, scenario: str, loss: str, steps: int, grid: Tuple[float, ...]) -> float:
        """The rate with the best whole-validation accepted drafts (T=1) at ``steps`` on seed 0,
        over ``grid`` extended by a half-decade past whichever end wins (up to
        ``lr_extensions`` times), so that the choice is not an edge of the grid."""
        seed = self.preset.seeds[0]
        scores: Dict[float, float] = {}
        todo = list(grid)
        for _ in range(self.preset.lr_extensions + 1):
            for lr in todo:
                record = self.arm(HeadsArm(scenario, loss, lr, seed, steps))
                scores[lr] = record['validation']['sampled']['accepted']
            best = max(scores, key=scores.get)
            if len(scores) == 1 or best not in (min(scores), max(scores)):
                break
            todo = [half_decade(best, up=best == max(scores))]
        return best

    def test_part(self, arm: HeadsArm) -> Dict:
        """Part ``test_<scenario>_<loss>_s<seed>``: the arm's final heads on the test split."""
        backbone, _ = self._start(arm)

        def run():
            heads = self.heads(arm)
            sets = self.eval_sets(backbone, ('tf_test', 'tf_continuation', 'prompts'))
            model = self.build(self.preset.depths, arm.loss, backbone=self.backbones[backbone],
                               heads=heads)
            return {'scenario': arm.scenario, 'loss': arm.loss, 'lr': arm.lr, 'seed': arm.seed,
                    'steps': arm.steps, 'depths': self.preset.depths,
                    'final': self.final_eval(model, sets)}

        return self.part(part_name(f'test_{arm.scenario}', arm.loss, arm.seed),
                         {**self.arm_key(arm), 'test': True}, run)

    # ------------------------------------------------------------------ cold start

    def run_cold(self) -> None:
        p = self.preset

        self.cold_init()
        first, *others = p.loss_names()  # 'ce': the official head of the drift scenario
        self.cold_lrs = self.run_losses('cold', p.cold_steps, p.lr_grid, [first])
        if 'drift' in p.scenarios:
            # Whether fine-tuning moves the backbone far enough decides the drift scenario: known
            # before the other losses' cold arms, not hours later.
            self.moved_backbone()
        self.cold_lrs.update(self.run_losses('cold', p.cold_steps, p.lr_grid, others))

    def run_official(self) -> None:
        """The official head: a fresh ``'ce'`` head on the original backbone, on the rate grid
        at the full budget, then at its plateau budget (:meth:`plateau_budget`), scored on the
        test split; then the fresh heads scored (``cold_init``). Its other seeds are the cold
        start's (S3), which runs after S1 and S2."""
        p = self.preset
        self.cold_lrs = self.run_losses('cold', p.cold_steps, p.lr_grid, ['ce'],
                                        seeds=p.seeds[:1])
        self.cold_init()

    def cold_init(self) -> Dict:
        """Part ``cold_init``: fresh heads before any training, and the main model, scored."""
        p = self.preset

        def init():
            sets = self.eval_sets('original', ('validation', 'tf_test', 'tf_continuation',
                                               'prompts'))
            model = self.build(p.depths, 'ce', seed=p.seeds[0],
                               backbone=self.backbones['original'])
            return {'scenario': 'cold', 'loss': None, 'depths': p.depths,
                    'data': self.code.describe(),
                    'validation': self.validation_summary(model, sets.validation),
                    'final': self.final_eval(model, sets),
                    'main_model': self.main_model_loss('original', sets.tf_test)}

        return self.part('cold_init', {'heads': 'fresh', 'seed': p.seeds[0]}, init)

    def run_losses(self, scenario: str, steps: int, grid: Tuple[float, ...],
                   losses: Optional[List[str]] = None,
                   seeds: Optional[Tuple[int, ...]] = None) -> Dict[str, float]:
        """Every loss in turn (default: the preset's): its grid on the first seed, then its best
        rate at its budget (:meth:`plateau_budget` under ``plateau_check``) on every seed of
        ``seeds`` (default: the preset's), each seed's heads scored on the test split. Returns
        each loss's rate."""
        lrs = {}
        for loss in losses if losses is not None else self.preset.loss_names():
            lrs[loss] = self.best_lr(scenario, loss, steps, grid)
            budget = steps
            if self.preset.plateau_check:
                budget = self.plateau_budget(scenario, loss, lrs[loss], steps)
            self.budgets[(scenario, loss)] = budget
            for seed in seeds if seeds is not None else self.preset.seeds:
                arm = HeadsArm(scenario, loss, lrs[loss], seed, budget)
                self.arm(arm)
                self.test_part(arm)
        return lrs

    def plateau_budget(self, scenario: str, loss: str, lr: float, steps: int) -> int:
        """The first budget from ``steps`` on whose double raises the first seed's validation
        tau (``1 +`` accepted drafts, T=1) by under ``plateau_gain``, doubling at most
        ``max_doublings`` times (the last budget tried if none does: the report says so)."""
        seed = self.preset.seeds[0]
        for _ in range(self.preset.max_doublings):
            short, long = (self.arm(HeadsArm(scenario, loss, lr, seed, n))
                           for n in (steps, 2 * steps))
            if tau_gain(short, long) < self.preset.plateau_gain:
                return steps
            steps *= 2
        return steps

    # ------------------------------------------------------------------ drift

    def official_arm(self) -> HeadsArm:
        return HeadsArm('cold', 'ce', self.cold_lrs['ce'], self.preset.seeds[0],
                        self.budgets[('cold', 'ce')])

    def official_key(self) -> Dict:
        return self.arm_key(self.official_arm())

    def official(self) -> Dict:
        """The official head: ``'ce'`` at its rate, trained to plateau on the original model."""
        return self.heads(self.official_arm())

    def fine_tune(self, model, steps: int, seed: int, lr: float, check=None,
                  checkpoint: Optional[str] = None) -> Dict:
        """``steps`` steps of full fine-tuning (the MTP loss too, if the model has heads) on the
        drift data, batch 1, constant rate after warm-up; ``check(model, step)`` every
        ``drift_check_every`` steps may stop it (returns True). Every ``checkpoint_every`` steps
        (at a check that did not stop it) the model, optimiser and curve go to ``checkpoint``
        (if given), where a rerun resumes. Returns the curve."""
        from cpu_demo_lib import model as M
        from mtp_tv_dev.models import forward_loss

        p = self.preset
        windows, mask = self.docs.train, torch.ones(1, p.block - 1)
        order = window_order(windows.shape[0], steps, 1, seed)
        params = M.set_trainable(model, 'all')
        optimizer = make_optimizer(params, lr)
        curve = {'step': [], 'main_loss': [], 'mtp_loss': [], 'checks': []}
        done = 0
        if checkpoint and os.path.exists(checkpoint):
            saved = torch.load(checkpoint)
            model.load_state_dict({**model.state_dict(), **saved['model']})
            optimizer.load_state_dict(saved['optimizer'])
            done, curve = saved['step'], saved['curve']
            self.log(f'fine-tuning at lr {lr:g}: resumed at step {done}')
        for step in range(done + 1, steps + 1):
            block = windows[order[step - 1]]
            model.train()
            loss = forward_loss(model, block[:, :-1], block[:, 1:], mask)
            main = (loss * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            main.backward()
            set_lr(optimizer, lr, step, p.warmup)
            optimizer.step()
            losses = M.mtp_tracker_losses()
            curve['step'].append(step)
            curve['main_loss'].append(float(main.detach()))
            curve['mtp_loss'].append(None if losses is None else float(losses.mean()))
            if check is not None and step % p.drift_check_every == 0:
                result = check(model, step)
                curve['checks'].append({'step': step, **result})
                if result.get('stop'):
                    break
                if checkpoint and step % p.checkpoint_every == 0 and step < steps:
                    self._save(checkpoint, {
                        'step': step, 'curve': curve, 'optimizer': optimizer.state_dict(),
                        'model': {k: v for k, v in model.state_dict().items()
                                  if torch.is_tensor(v)}})
        return curve

    def drift_key(self) -> Dict:
        p = self.preset
        return {'backbone': 'moved', 'heads': self.official_key(), 'data': 'pydoc',
                'sha256': self.docs.sha256, 'lrs': list(p.drift_lrs),
                'max_steps': p.drift_max_steps, 'target': p.drift_target, 'seed': 41}

    def head_alpha(self, backbone_state: Dict, windows) -> Dict:
        """The official head's validation summary on ``backbone_state`` (states recomputed)."""
        from smollm2_lib import evaluate as E
        from smollm2_lib import heads as H

        model = self.build(None, 'ce', backbone=backbone_state)
        states = H.cache_states(model, windows, 4, 'moving backbone: validation windows')
        data = E.TeacherForcedSet.build('check', model, windows, states, self.preset.context)
        heads_model = self.build(1, 'ce', backbone=backbone_state, heads=self.official())
        return self.validation_summary(heads_model, data)

    def moved_backbone(self) -> Dict:
        """Part ``drift_move``: the original backbone fine-tuned on the drift data until the
        official head's alpha on the curve windows fell by ``drift_target``; returns it."""
        p = self.preset
        key = self.drift_key()
        checkpoints = {lr: self._runs_path(f"drift-{self.store.fingerprint({**key, 'lr': lr})}.pt")
                       for lr in p.drift_lrs}

        def move() -> Tuple[Dict, Dict]:
            windows = self.code.validation[: p.curve_windows, : 2 * p.context]
            before = self.head_alpha(self.backbones['original'], windows)
            target = before['sampled']['alpha'][0] - p.drift_target

            def check(m, step):
                state = self.backbone_of(m)
                now = self.head_alpha(state, windows)
                alpha = now['sampled']['alpha'][0]
                self.log(f'drift: step {step}, official head alpha {alpha:.4f} '
                         f'(from {before["sampled"]["alpha"][0]:.4f}; target {target:.4f})')
                self.build(None, 'ce', backbone=state)  # the training model, restored
                return {'alpha': alpha, 'stop': alpha <= target}

            attempts = []
            for lr in p.drift_lrs:  # from the original backbone each time
                model = self.build(None, 'ce', backbone=self.backbones['original'])
                curve = self.fine_tune(model, p.drift_max_steps, seed=41, lr=lr, check=check,
                                       checkpoint=checkpoints[lr])
                reached = bool(curve['checks'] and curve['checks'][-1]['stop'])
                attempts.append({'lr': lr, 'steps': curve['step'][-1], 'curve': curve,
                                 'target_reached': reached})
                if reached:
                    break
            record = {'scenario': 'drift', **attempts[-1], 'earlier_attempts': attempts[:-1],
                      'head_before': before}
            return record, self.backbone_of(model)

        result = {}

        def run():
            record, state = move()
            result['state'] = state
            return record

        record = self.part('drift_move', key, run)
        for path in checkpoints.values():  # 1.6 GB each, of use only until the part is stored
            if path and os.path.exists(path):
                os.remove(path)
        self.drift_steps, self.drift_lr = record['steps'], record['lr']

        def replay() -> Dict:
            replayed, state = move()
            self.log_replay('drift_move', "official head's alpha at the last check",
                            *(r['curve']['checks'][-1]['alpha'] for r in (replayed, record)))
            return state

        state = self.kept_weights(key, lambda: result.get('state') or replay())
        self.backbones['moved'] = state
        return state

    def run_drift(self) -> None:
        p = self.preset
        self.moved_backbone()
        for name, backbone in (('drift_before', 'original'), ('drift_after', 'moved')):
            def score(backbone=backbone):
                sets = self.eval_sets(backbone, ('validation', 'tf_test', 'tf_continuation',
                                                 'prompts'))
                model = self.build(1, 'ce', backbone=self.backbones[backbone],
                                   heads=self.official())
                return {'scenario': 'drift', 'backbone': backbone, 'loss': None, 'depths': 1,
                        'curve_validation': self.validation_summary(model, sets.curve),
                        'validation': self.validation_summary(model, sets.validation),
                        'final': self.final_eval(model, sets),
                        'main_model': self.main_model_loss(backbone, sets.tf_test)}

            self.part(name, {'heads': self.official_key(), 'backbone': backbone,
                             **({'drift': self.drift_key()} if backbone == 'moved' else {})},
                      score)
        self.release('original')
        self.run_losses('heal', p.heal_steps, p.heal_lr_grid)

    # ------------------------------------------------------------------ joint

    def run_joint(self) -> None:
        """The drift's fine-tuning, for as many steps, with the official head attached and
        trained together with the backbone, every loss."""
        p = self.preset
        if 'moved' not in self.backbones:
            self.moved_backbone()
        for loss in p.loss_names():
            for seed in p.joint_seeds:
                name = part_name('joint', loss, seed)

                def run(loss=loss, seed=seed, name=name):
                    model = self.build(1, loss, joint=True, backbone=self.backbones['original'],
                                       heads=self.official())
                    curve = self.fine_tune(model, self.drift_steps, seed=41 + seed,
                                           lr=self.drift_lr)
                    self.backbones[name] = self.backbone_of(model)
                    heads = self.heads_of(model)
                    sets = self.eval_sets(name, ('tf_test', 'tf_continuation', 'prompts'))
                    model = self.build(1, loss, joint=True, backbone=self.backbones[name],
                                       heads=heads)
                    record = {'scenario': 'joint', 'loss': loss, 'seed': seed, 'lr': self.drift_lr,
                              'steps': self.drift_steps, 'depths': 1,
                              'mtp_loss_scaling_factor': p.joint_mtp_scale, 'curve': curve,
                              'final': self.final_eval(model, sets),
                              'main_model': self.main_model_loss(name, sets.tf_test)}
                    self.release(name)
                    del self.backbones[name]
                    return record

                self.part(name, {'heads': self.official_key(), 'drift': self.drift_key(),
                                 'loss': loss, 'seed': seed, 'steps': self.drift_steps,
                                 'mtp_loss_scaling_factor': p.joint_mtp_scale}, run)

    # ------------------------------------------------------------------ scoring

    def validation_summary(self, model, data) -> Dict:
        from smollm2_lib import evaluate as E

        tf = E.teacher_forced(model, data, self.preset.depths, self.preset.serving_temperature)
        return {mode: {'accepted': tf[mode]['accepted']['mean'],
                       'alpha': [a['mean'] for a in tf[mode]['alpha']]}
                for mode in (E.SAMPLED, E.GREEDY)}

    def final_eval(self, model, sets: EvalSets, seed: int = 29) -> Dict:
        """Teacher-forced on test text and on the backbone's own continuations, speculative
        decoding at T=1 and greedy on the test prompts (common random numbers: ``seed``)."""
        from smollm2_lib import evaluate as E

        p = self.preset
        gamma = p.depths
        out = {'tf_test': E.teacher_forced(model, sets.tf_test, gamma, p.serving_temperature),
               'tf_continuation': E.teacher_forced(model, sets.tf_continuation, gamma,
                                                   p.serving_temperature)}
        for key, temperature in (('spec_sampled', 1.0), ('spec_greedy', 0.0)):
            out[key] = E.speculative_decoding(model, sets.prompts, gamma, p.spec_rounds,
                                              temperature, seed)
        return out

    def main_model_loss(self, backbone: str, data) -> Dict:
        """The main model's held-out NLL per token on ``data``'s windows (context >= t0 + 1),
        ``data`` being ``backbone``'s states."""
        from smollm2_lib.evaluate import mean_and_se

        model = self.build(None, 'ce', backbone=self.backbones[backbone])
        per_window = []
        for start in range(0, data.windows.shape[0], 4):
            z = data.target_logits(model, start, start + 4)[:-1]  # predict t0+2 .. S-1
            labels = data.windows[start : start + 4, data.t0 + 2 :].transpose(0, 1)
            nll = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]),
                                                    labels.reshape(-1), reduction='none')
            per_window.append(nll.view(labels.shape).mean(0))
        per_window = torch.cat(per_window)
        return {'nll': mean_and_se(per_window), 'per_window': per_window.tolist()}

    # ------------------------------------------------------------------ all

    def run(self) -> Dict[str, Dict]:
        """The scenarios in order of what they decide; each frees the sets the next ones do
        not read."""
        scenarios = self.preset.scenarios
        if scenarios[0] == 'official':  # issue 59's order: the official head, then S1-S3
            self.run_official()
            return self.store.all()
        self.run_cold()  # every scenario starts from the cold start's official head
        if 'drift' in scenarios:
            self.run_drift()
        if 'joint' in scenarios:
            self.run_joint()
        return self.store.all()
