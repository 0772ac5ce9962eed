"""The SmolLM2 experiment: its presets, its parts, and a store that lets a rerun skip what is done.

Scenarios (each a sequence of *parts*; a part trains one arm or one backbone and evaluates it):

* ``cold``: fresh MTP heads (one depth) on the pretrained backbone, trained on English docs
  (domain B) with every loss of the registry whose one-depth objective is its own (``'e2e_tv'``
  is ``'tv'`` at one depth: it joins the chain), each at its best learning rate of a short sweep
  on the validation split (``sweep_cold_*``), for each seed (``cold_<loss>_s<seed>``);
* ``chain``: fresh heads with ``chain_depths`` depths, ``'tv'``, ``'e2e_tv'`` and the best
  one-depth loss on the validation split (``chain_<loss>``);
* ``graft``: the ``'ce'`` head of ``cold_ce_s0`` (the "official" head, trained on the original
  backbone) grafted onto the backbone fine-tuned on code (domain A) without heads (``sft``), and
  healed there on code with every loss (``heal_<loss>_s<seed>``, learning rates from
  ``sweep_heal_*``); ``graft_before`` / ``graft_drifted`` measure the head before and after the
  drift;
* ``joint``: the same fine-tuning with the official head attached and trained together with the
  backbone (``joint_ce``, ``joint_tv``): acceptance, and the main model's own held-out loss
  against ``sft``'s.

Every part writes ``<results>/parts/<name>.json`` when it finishes (``--commit`` also commits it);
a rerun loads the parts whose settings fingerprint matches and runs only the rest. Weights a later
part needs (the official head, the fine-tuned backbone) are kept in the cache folder, and
retrained from their part's settings where a fresh machine lacks them.
"""

import hashlib
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

#: Bumped when a change to the code changes what a part computes: old parts are then rerun.
EXPERIMENT_VERSION = 1
#: How many times a learning-rate sweep may extend its grid past the winning end.
SWEEP_EXTENSIONS = 2


@dataclass(frozen=True)
class Preset:
    """Sizes of one run. Steps are optimiser steps of ``batch`` training windows."""

    name: str
    scenarios: Tuple[str, ...]
    seeds: Tuple[int, ...]
    batch: int = 2
    block: int = 513
    """Tokens per data block: a training window (``block - 1`` tokens) and its labels; an
    evaluation window is the first ``2 * context`` tokens of a block."""
    cold_steps: int = 100
    lr_grid: Tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """Learning rates of the cold sweep (one value: no sweep)."""
    fixed_lrs: Tuple[Tuple[str, float], ...] = ()
    """``(loss, lr)`` pairs that replace the cold sweep for those losses."""
    sweep_fraction: float = 1 / 3
    """A sweep arm trains this fraction of its scenario's steps."""
    chain_depths: int = 3
    chain_steps: int = 80
    sft_steps: int = 60
    sft_lr: float = 1e-4
    heal_steps: int = 50
    heal_lr_grid: Tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    joint_steps: int = 60
    joint_mtp_scale: float = 0.1
    lk_eta: float = 3.0
    serving_temperature: float = 0.7
    curve_points: int = 6
    """Held-out (validation) evaluations per arm, evenly spaced, the last at the end."""
    context: int = 256
    """Scored positions have at least this many tokens of context; prompts are this long."""
    tf_windows: int = 32
    validation_windows: int = 8
    continuation_prompts: int = 32
    spec_prompts: int = 92
    spec_rounds: int = 12
    stdlib_chars: int = 1_500_000
    threads: int = 2

    def common(self) -> Dict:
        """The settings every part of a run shares (data, evaluation): a part stored under
        other values of these is not reused. What one part trains (its loss, learning rate,
        seed, steps, the head or backbone it starts from) is that part's own key."""
        keys = ('block', 'batch', 'context', 'tf_windows', 'validation_windows',
                'continuation_prompts', 'spec_prompts', 'spec_rounds', 'stdlib_chars',
                'serving_temperature', 'curve_points', 'lk_eta')
        return {'version': EXPERIMENT_VERSION, **{k: getattr(self, k) for k in keys}}


def depth_one_losses() -> List[str]:
    """``'ce'`` and the registry's losses whose objective is per depth (``per_chain`` losses
    equal a per-depth one at one depth and join the chain scenario instead)."""
    from megatron.mtp_tv.losses import LOSSES

    return ['ce'] + [name for name, cls in LOSSES.items() if not cls.per_chain]


def chain_losses() -> List[str]:
    from megatron.mtp_tv.losses import LOSSES

    return ['tv'] + [name for name, cls in LOSSES.items() if cls.per_chain]


PRESETS: Dict[str, Preset] = {
    'long': Preset(name='long', scenarios=('cold', 'graft', 'joint', 'chain'), seeds=(0, 1)),
    # The cold-start ranking within 30 minutes (measured: docs/smollm2_demo.md, Presets): 40
    # steps, one seed, each loss at the learning rate the long preset's sweep chose
    # (examples/smollm2_results/long/report.md), the same evaluation. A loss the sweep has not
    # seen yet runs at lr_grid's value.
    'default': Preset(name='default', scenarios=('cold',), seeds=(0,), cold_steps=40,
                      lr_grid=(1e-3,), curve_points=4,
                      fixed_lrs=(('ce', 1e-3), ('tv', 3e-4), ('kl', 1e-3), ('lk', 3e-4),
                                 ('nla', 3e-4))),
    # The code paths of both presets at toy sizes (tests/test_smollm2.py), on one thread: the
    # test runs beside another pytest-xdist worker, where two threads wait on each other in
    # OpenMP's barriers (on 2 cores: 120-210 s, against 80 s on one thread).
    'smoke': Preset(name='smoke', scenarios=('cold', 'graft', 'joint', 'chain'), seeds=(0,),
                    block=33, cold_steps=3, lr_grid=(1e-3, 3e-3), chain_depths=2, chain_steps=2,
                    sft_steps=2, heal_steps=3, heal_lr_grid=(1e-3,), joint_steps=2,
                    curve_points=2, context=8, tf_windows=2, validation_windows=2,
                    continuation_prompts=2, spec_prompts=3, spec_rounds=2, stdlib_chars=60_000,
                    batch=1, threads=1),
}


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
            self._commit(name, path)
        return record

    def _commit(self, name: str, path: str) -> None:
        """Commit one part file alone; a failure (another git command holding the index) is
        retried, then reported, never fatal: the file is written and a rerun keeps it."""
        for attempt in range(5):
            add = subprocess.run(['git', 'add', path], cwd=self.directory, capture_output=True)
            done = add.returncode == 0 and subprocess.run(
                ['git', 'commit', '-q', '-m', f'smollm2 results: part {name}', '--', path],
                cwd=self.directory, capture_output=True).returncode == 0
            if done:
                return
            time.sleep(2 + 3 * attempt)
        print(f'part {name}: written, but git commit failed; commit {path} by hand',
              flush=True)

    def all(self) -> Dict[str, Dict]:
        """Every stored part made under the same common settings (for the report)."""
        folder = os.path.join(self.directory, 'parts')
        names = sorted(n[:-5] for n in os.listdir(folder) if n.endswith('.json')) \
            if os.path.isdir(folder) else []
        records = {n: self._read(n) for n in names}
        return {n: r for n, r in records.items() if r.get('common') == self.common}


def half_decade(lr: float, up: bool) -> float:
    """The next value on the 1-3-10 ladder above or below ``lr`` (1e-3 -> 3e-3 or 3e-4)."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10 ** exponent)
    ladder = [(m, e) for e in (exponent - 1, exponent, exponent + 1) for m in (1, 3)]
    i = ladder.index((mantissa, exponent))
    m, e = ladder[i + 1 if up else i - 1]
    return float(f'{m}e{e}')


def schedule_points(steps: int, count: int) -> List[int]:
    """``count`` evaluation steps evenly spaced over ``1 .. steps``, the last at ``steps``."""
    return sorted({max(1, round(steps * i / count)) for i in range(1, count + 1)})


def window_order(count: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """``[steps, batch]`` indices of training windows: seeded permutations, epoch after epoch."""
    generator = torch.Generator().manual_seed(seed)
    need = steps * batch
    order = torch.cat([torch.randperm(count, generator=generator)
                       for _ in range(math.ceil(need / count))])
    return order[:need].view(steps, batch)


@dataclass
class BackboneSets:
    """What every arm on one backbone is evaluated on (built once, on demand)."""

    tf_test: object = None
    tf_validation: object = None
    tf_continuation: object = None
    prompts: object = None
    train_states: Dict[int, torch.Tensor] = field(default_factory=dict)


class Experiment:
    """Runs the parts of ``preset`` that ``store`` lacks."""

    def __init__(self, preset: Preset, store: Store, cache_dir: Optional[str],
                 log: Callable[[str], None] = print):
        """``cache_dir``: the converted checkpoint's folder (``weights.load_hf``; None: its
        default, '' none); weights later parts need go to ``<it>/runs/``."""
        self.preset, self.store, self.log = preset, store, log
        from smollm2_lib.weights import default_cache_dir

        self.cache_dir = cache_dir
        root = default_cache_dir() if cache_dir is None else cache_dir
        self.weights_dir = os.path.join(root, 'runs') if root else None
        self.records: Dict[str, Dict] = {}
        self.kept: Dict[str, Dict] = {}
        self.models: Dict[Tuple, object] = {}
        self.fresh: Dict[Tuple[int, int], Dict] = {}
        self.timings: Dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        from smollm2_lib import data as DATA
        from smollm2_lib import weights as W

        p = self.preset
        t0 = time.monotonic()
        hf_model, tokenizer = W.load_hf(self.cache_dir)
        self.hf_config = hf_model.config
        if 2 * p.context > p.block - 1:
            raise ValueError(f'context {p.context}: evaluation windows of {2 * p.context} tokens '
                             f'do not fit blocks of {p.block}')
        self.domains = {'B': DATA.load_domain('B', 'pydoc', tokenizer, block=p.block),
                        'A': DATA.load_domain('A', 'stdlib', tokenizer, p.stdlib_chars, p.block)}
        model = self.build(None, 'ce')
        W.load_backbone(model, hf_model)
        self.original = self.backbone_of(model)
        del hf_model
        self.sets: Dict[Tuple[str, str], BackboneSets] = {}
        self.timings['setup'] = time.monotonic() - t0

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
                mtp_lk_eta=self.preset.lk_eta)
            return W.build_megatron(self.hf_config, depths, self.preset.block - 1,
                                    seed=build_seed * 1000 + 5, **overrides)

        key = (depths, joint)
        if key not in self.models:
            self.models[key] = make(seed)
            if depths is not None:
                self.fresh.setdefault((depths, seed), self.heads_of(self.models[key]))
        model = self.models[key]
        if depths is not None:
            model.config.mtp_loss_type = loss  # read (and validated) by every MTP loss call
            if heads is None:
                if (depths, seed) not in self.fresh:
                    self.fresh[(depths, seed)] = self.heads_of(make(seed))
                heads = self.fresh[(depths, seed)]
        model.load_state_dict({**model.state_dict(), **(backbone or {}), **(heads or {})})
        MTPLossLoggingHelper.tracker.clear()
        return model

    def release(self, backbone_name: str, domain: str, keep: Tuple[str, ...] = ()) -> None:
        """Free a backbone's evaluation sets (each a few GB), but those in ``keep``."""
        sets = self.sets.get((backbone_name, domain))
        if sets is None:
            return
        kept = BackboneSets(**{n: getattr(sets, n) for n in keep})
        self.sets[(backbone_name, domain)] = kept

    def backbone_sets(self, backbone_name: str, backbone: Dict, domain: str,
                      need: Tuple[str, ...]) -> BackboneSets:
        """Evaluation sets of one (backbone, domain), built on first use and kept."""
        from smollm2_lib import evaluate as E
        from smollm2_lib import heads as H

        p = self.preset
        sets = self.sets.setdefault((backbone_name, domain), BackboneSets())
        missing = [n for n in need if getattr(sets, n) is None]
        if not missing:
            return sets
        t0 = time.monotonic()
        model = self.build(None, 'ce', backbone=backbone)  # no heads: states and logits
        blocks = self.domains[domain]
        window = p.context * 2
        label = f'{backbone_name} backbone, domain {domain}'
        for name in missing:
            if name == 'tf_test':
                windows = blocks.test[: p.tf_windows, :window]
                states = H.cache_states(model, windows, 4, f'{label}: test windows')
                sets.tf_test = E.TeacherForcedSet.build('test', model, windows, states, p.context)
            elif name == 'tf_validation':
                windows = blocks.validation[: p.validation_windows, :window]
                states = H.cache_states(model, windows, 4, f'{label}: validation windows')
                sets.tf_validation = E.TeacherForcedSet.build('validation', model, windows,
                                                              states, p.context)
            elif name == 'tf_continuation':
                # the last test blocks' openings, continued by the main model itself at T=1
                prompts = blocks.test[-p.continuation_prompts:, : p.context]
                windows = E.generate(model, prompts, p.context, 1.0, seed=17)
                states = H.cache_states(model, windows, 4, f'{label}: sampled continuations')
                sets.tf_continuation = E.TeacherForcedSet.build('continuation', model, windows,
                                                                states, p.context)
            elif name == 'prompts':
                halves = blocks.test[:, : 2 * p.context].reshape(-1, p.context)
                tokens = halves[: p.spec_prompts]
                capacity = p.context + p.spec_rounds * (p.chain_depths + 1) + 2 * p.chain_depths + 2
                sets.prompts = E.Prompts.prefill(model, tokens, capacity)
        self.timings[f'eval_sets {label}'] = (self.timings.get(f'eval_sets {label}', 0.0)
                                              + time.monotonic() - t0)
        return sets

    def train_states(self, backbone_name: str, backbone: Dict, domain: str,
                     indices: torch.Tensor) -> Dict[int, torch.Tensor]:
        """The backbone's states ``[block - 1, 1, h]`` of the training windows ``indices``."""
        from smollm2_lib import heads as H

        sets = self.sets.setdefault((backbone_name, domain), BackboneSets())
        todo = sorted({int(i) for i in indices.flatten()} - set(sets.train_states))
        if todo:
            model = self.build(None, 'ce', backbone=backbone)  # no heads: states and logits
            windows = self.domains[domain].train[todo, :-1]
            states = H.cache_states(model, windows, 4,
                                    f'{backbone_name} backbone, domain {domain}: train windows')
            for j, i in enumerate(todo):
                sets.train_states[i] = states[:, j : j + 1]
        return sets.train_states

    # ------------------------------------------------------------------ training

    def train_heads(self, model, backbone_name: str, backbone: Dict, domain: str, steps: int,
                    lr: float, seed: int, validation: Optional[object]) -> Dict:
        """Heads only, on cached backbone states; returns the curves."""
        from cpu_demo_lib import model as M
        from smollm2_lib import heads as H

        p = self.preset
        order = window_order(self.domains[domain].train.shape[0], steps, p.batch, seed)
        states = self.train_states(backbone_name, backbone, domain, order)
        params = H.freeze_backbone(model)
        optimizer, schedule = M.make_optimizer(params, lr, steps)
        curve = {'step': [], 'mtp_loss': [], 'grad_norm': [], 'validation': []}
        points = set(schedule_points(steps, p.curve_points)) if validation is not None else set()
        gamma = model.config.mtp_num_layers
        for step in range(1, steps + 1):
            rows = order[step - 1]
            blocks = self.domains[domain].train[rows]
            main = torch.cat([states[int(i)] for i in rows], dim=1)
            stats = H.train_step(model, optimizer, blocks[:, :-1], blocks[:, 1:], main, None)
            schedule.step()
            curve['step'].append(step)
            curve['mtp_loss'].append(stats['mtp_loss'])
            curve['grad_norm'].append(stats['grad_norm'])
            if step in points:
                curve['validation'].append({'step': step, **self.validation_summary(
                    model, validation, gamma)})
        return curve

    def train_full(self, model, domain: str, steps: int, lr: float, seed: int,
                   validation: Optional[Callable] = None) -> Dict:
        """Backbone (and heads, if the model has them) on the main loss (+ the MTP loss)."""
        from cpu_demo_lib import model as M

        p = self.preset
        order = window_order(self.domains[domain].train.shape[0], steps, 1, seed)
        params = M.set_trainable(model, 'all')
        optimizer, schedule = M.make_optimizer(params, lr, steps)
        curve = {'step': [], 'main_loss': [], 'mtp_loss': [], 'grad_norm': [], 'validation': []}
        points = set(schedule_points(steps, max(2, p.curve_points // 2))) if validation else set()
        for step in range(1, steps + 1):
            blocks = self.domains[domain].train[order[step - 1]]
            stats: Dict = {}
            main = M.train_step(model, optimizer, blocks[:, :-1], blocks[:, 1:], clip=1.0,
                                stats=stats)
            schedule.step()
            losses = M.mtp_tracker_losses()
            curve['step'].append(step)
            curve['main_loss'].append(main)
            curve['mtp_loss'].append(None if losses is None else float(losses.mean()))
            curve['grad_norm'].append(stats['grad_norm'])
            if step in points:
                curve['validation'].append({'step': step, **validation(model)})
        return curve

    # ------------------------------------------------------------------ evaluation

    def validation_summary(self, model, validation, gamma: int) -> Dict:
        from smollm2_lib import evaluate as E

        tf = E.teacher_forced(model, validation, gamma, self.preset.serving_temperature)
        return {mode: {'accepted': tf[mode]['accepted']['mean'],
                       'alpha': [a['mean'] for a in tf[mode]['alpha']]}
                for mode in (E.SAMPLED, E.GREEDY)}

    def final_eval(self, model, sets: BackboneSets, gamma: int, seed: int = 29) -> Dict:
        """Teacher-forced on test text (and sampled continuations where built), speculative
        decoding at T=1 and greedy on the test prompts (common random numbers: ``seed``)."""
        from smollm2_lib import evaluate as E

        p = self.preset
        out = {'tf_test': E.teacher_forced(model, sets.tf_test, gamma, p.serving_temperature)}
        if sets.tf_continuation is not None:
            out['tf_continuation'] = E.teacher_forced(model, sets.tf_continuation, gamma,
                                                      p.serving_temperature)
        for key, temperature in (('spec_sampled', 1.0), ('spec_greedy', 0.0)):
            out[key] = E.speculative_decoding(model, sets.prompts, gamma, p.spec_rounds,
                                              temperature, seed)
        return out

    @staticmethod
    def main_model_loss(sets: BackboneSets) -> Dict:
        """The main model's held-out NLL per token on the test windows (context >= t0 + 1)."""
        data = sets.tf_test
        z = data.target_logits[:-1]  # positions t0+1 .. S-2 predict tokens t0+2 .. S-1
        labels = data.windows[:, data.t0 + 2 :].transpose(0, 1)
        nll = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1),
                                                reduction='none').view(labels.shape)
        from smollm2_lib.evaluate import mean_and_se

        return {'nll': mean_and_se(nll.mean(0)), 'per_window': nll.mean(0).tolist()}

    # ------------------------------------------------------------------ parts

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

    def _weights_path(self, key: Dict) -> Optional[str]:
        if self.weights_dir is None:
            return None
        return os.path.join(self.weights_dir, f'{self.store.fingerprint(key)}.pt')

    def keep(self, key: Dict, record: Dict, state: Dict) -> Dict:
        """Cache ``state``, the weights the part made from ``key`` that later parts need, and
        return ``record``."""
        path = self._weights_path(key)
        if path:
            os.makedirs(self.weights_dir, exist_ok=True)
            torch.save(state, path + '.tmp')
            os.replace(path + '.tmp', path)
        self.kept[fingerprint(key)] = state
        return record

    def kept_weights(self, key: Dict, remake: Callable[[], Dict]) -> Dict:
        """Weights :meth:`keep` cached: in memory, in the cache folder, else ``remake()``."""
        if fingerprint(key) not in self.kept:
            path = self._weights_path(key)
            if path and os.path.exists(path):
                self.kept[fingerprint(key)] = torch.load(path)
            else:
                self.log(f'weights of {key}: not in the cache folder; retraining them')
                self.keep(key, {}, remake())
        return self.kept[fingerprint(key)]

    @staticmethod
    def heads_of(model) -> Dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if k.startswith('mtp.') and torch.is_tensor(v)}

    @staticmethod
    def backbone_of(model) -> Dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if not k.startswith('mtp.') and torch.is_tensor(v)}

    def best_lr(self, kind: str, loss: str, grid: Tuple[float, ...], steps: int, base: Dict,
                run_arm: Callable[..., Tuple[Dict, Dict]]) -> float:
        """The learning rate with the best validation accepted drafts (T=1) after a
        ``sweep_fraction`` run from seed 0 (``base``: what the arms start from), over ``grid``
        extended by a half-decade past whichever end wins (up to :data:`SWEEP_EXTENSIONS`
        times), so that the choice is not an edge of the grid; the grid's only value without a
        sweep, or the preset's fixed one."""
        fixed = dict(self.preset.fixed_lrs)
        if kind == 'cold' and loss in fixed:
            return fixed[loss]
        if len(grid) == 1:
            return grid[0]
        steps = max(1, round(steps * self.preset.sweep_fraction))
        scores: Dict[float, float] = {}
        todo = list(grid)
        for _ in range(SWEEP_EXTENSIONS + 1):
            for lr in todo:
                key = {**base, 'loss': loss, 'lr': lr, 'seed': 0, 'steps': steps}
                record = self.part(f'sweep_{kind}_{loss}_lr{lr:g}', key,
                                   lambda lr=lr: run_arm(loss, lr, 0, steps)[0])
                scores[lr] = record['curve']['validation'][-1]['sampled']['accepted']
            best = max(scores, key=scores.get)
            if best not in (min(scores), max(scores)):
                break
            todo = [half_decade(best, up=best == max(scores))]
        return best

    # cold and chain ----------------------------------------------------------

    def cold_arm(self, loss: str, lr: float, seed: int, steps: int, depths: int = 1,
                 final: bool = False) -> Tuple[Dict, Dict]:
        """Fresh heads (seeded by ``seed``) on the original backbone, trained on domain B:
        ``(record, heads)``."""
        sets = self.backbone_sets('original', self.original, 'B', ('tf_validation',) + (
            ('tf_test', 'tf_continuation', 'prompts') if final else ()))
        model = self.build(depths, loss, seed=seed, backbone=self.original)
        curve = self.train_heads(model, 'original', self.original, 'B', steps, lr, seed,
                                 sets.tf_validation)
        record = {'scenario': 'chain' if depths > 1 else 'cold', 'loss': loss, 'lr': lr,
                  'seed': seed, 'steps': steps, 'depths': depths, 'curve': curve}
        if final:
            record['final'] = self.final_eval(model, sets, depths)
        return record, self.heads_of(model)

    def cold_key(self, loss: str, lr: float, seed: int, steps: int, depths: int = 1) -> Dict:
        return {'heads': 'fresh', 'domain': 'B', 'loss': loss, 'lr': lr, 'seed': seed,
                'steps': steps, 'depths': depths}

    def run_cold(self) -> Dict[str, float]:
        """Every part of the cold scenario; returns each loss's chosen learning rate."""
        p = self.preset

        def init():
            sets = self.backbone_sets('original', self.original, 'B', (
                'tf_validation', 'tf_test', 'tf_continuation', 'prompts'))
            model = self.build(1, 'ce', seed=0, backbone=self.original)
            return {'scenario': 'cold', 'loss': None, 'depths': 1,
                    'validation': self.validation_summary(model, sets.tf_validation, 1),
                    'final': self.final_eval(model, sets, 1),
                    'main_model': self.main_model_loss(sets)}

        self.part('cold_init', {'heads': 'fresh', 'seed': 0}, init)
        lrs = {}
        for loss in depth_one_losses():
            lrs[loss] = self.best_lr('cold', loss, p.lr_grid, p.cold_steps,
                                     {'heads': 'fresh', 'domain': 'B', 'depths': 1},
                                     self.cold_arm)
            for seed in p.seeds:
                key = self.cold_key(loss, lrs[loss], seed, p.cold_steps)

                def arm(loss=loss, seed=seed, key=key):
                    record, heads = self.cold_arm(loss, lrs[loss], seed, p.cold_steps, final=True)
                    # cold_ce_s0's head is the graft scenario's official head
                    return self.keep(key, record, heads) if (loss, seed) == ('ce', 0) else record

                self.part(f'cold_{loss}_s{seed}', key, arm)
        return lrs

    def official_key(self, lrs: Dict[str, float]) -> Dict:
        return self.cold_key('ce', lrs['ce'], 0, self.preset.cold_steps)

    def official_head(self, lrs: Dict[str, float]) -> Dict:
        """The heads of part ``cold_ce_s0``: an official head, 'ce' on the original model."""
        return self.kept_weights(self.official_key(lrs), lambda: self.cold_arm(
            'ce', lrs['ce'], 0, self.preset.cold_steps)[1])

    def run_chain(self, lrs: Dict[str, float]) -> None:
        p = self.preset
        cold = {loss: self.records.get(f'cold_{loss}_s0') for loss in depth_one_losses()}
        best = max((loss for loss, r in cold.items() if r is not None),
                   key=lambda loss: cold[loss]['curve']['validation'][-1]['sampled']['accepted'])
        for loss in dict.fromkeys(chain_losses() + [best]):
            lr = lrs.get(loss, lrs['tv'])  # a per-chain loss is 'tv' at one depth
            self.part(f'chain_{loss}', self.cold_key(loss, lr, 0, p.chain_steps, p.chain_depths),
                      lambda loss=loss, lr=lr: {
                          **self.cold_arm(loss, lr, 0, p.chain_steps, depths=p.chain_depths,
                                          final=True)[0],
                          'chosen_as': ('the best one-depth loss on validation' if loss == best
                                        else 'chain')})

    # graft and joint ---------------------------------------------------------

    def sft_key(self) -> Dict:
        return {'backbone': 'fine-tuned', 'domain': 'A', 'steps': self.preset.sft_steps,
                'lr': self.preset.sft_lr, 'seed': 41}

    def fine_tune(self) -> Tuple[Dict, Dict]:
        """The original backbone fine-tuned on code (domain A), no MTP heads: the SFT that moves
        the main model away from its official head. ``(curve, backbone)``."""
        p = self.preset
        model = self.build(None, 'ce', backbone=self.original)
        curve = self.train_full(model, 'A', p.sft_steps, p.sft_lr, seed=41)
        return curve, self.backbone_of(model)

    def sft_backbone(self) -> Dict:
        p = self.preset

        def run():
            before = self.main_losses('original', self.original)
            curve, backbone = self.fine_tune()
            record = {'scenario': 'graft', 'steps': p.sft_steps, 'lr': p.sft_lr, 'curve': curve,
                      'main_model_before': before,
                      'main_model': self.main_losses('sft', backbone)}
            return self.keep(self.sft_key(), record, backbone)

        self.part('sft', self.sft_key(), run)
        return self.kept_weights(self.sft_key(), lambda: self.fine_tune()[1])

    def main_losses(self, name: str, backbone: Dict) -> Dict:
        """The main model's held-out loss on both domains' test windows."""
        return {d: self.main_model_loss(self.backbone_sets(name, backbone, d, ('tf_test',)))
                for d in ('A', 'B')}

    def heal_arm(self, loss: str, lr: float, seed: int, steps: int,
                 final: bool = False) -> Tuple[Dict, Dict]:
        """The official head on the fine-tuned backbone, healed on code with ``loss``."""
        sft = self.sft_state
        sets = self.backbone_sets('sft', sft, 'A', ('tf_validation',) + (
            ('tf_test', 'tf_continuation', 'prompts') if final else ()))
        model = self.build(1, loss, backbone=sft, heads=self.official)
        curve = self.train_heads(model, 'sft', sft, 'A', steps, lr, seed, sets.tf_validation)
        record = {'scenario': 'graft', 'loss': loss, 'lr': lr, 'seed': seed, 'steps': steps,
                  'depths': 1, 'curve': curve}
        if final:
            record['final'] = self.final_eval(model, sets, 1)
        return record, self.heads_of(model)

    def run_graft(self, lrs: Dict[str, float], seeds: Sequence[int]) -> None:
        from smollm2_lib import evaluate as E

        p = self.preset
        self.official = self.official_head(lrs)
        self.sft_state = self.sft_backbone()
        graft = {'heads': self.official_key(lrs), 'backbone': self.sft_key()}

        def before():  # the official head on the model it was trained for, on code
            sets = self.backbone_sets('original', self.original, 'A',
                                      ('tf_test', 'tf_validation'))
            model = self.build(1, 'ce', backbone=self.original, heads=self.official)
            return {'scenario': 'graft', 'loss': None, 'depths': 1,
                    'validation': self.validation_summary(model, sets.tf_validation, 1),
                    'final': {'tf_test': E.teacher_forced(model, sets.tf_test, 1,
                                                          p.serving_temperature)}}

        def drifted():  # the same head grafted onto the fine-tuned model, not healed
            sets = self.backbone_sets('sft', self.sft_state, 'A', (
                'tf_validation', 'tf_test', 'tf_continuation', 'prompts'))
            model = self.build(1, 'ce', backbone=self.sft_state, heads=self.official)
            return {'scenario': 'graft', 'loss': None, 'depths': 1,
                    'validation': self.validation_summary(model, sets.tf_validation, 1),
                    'final': self.final_eval(model, sets, 1)}

        self.part('graft_before', {'heads': graft['heads'], 'domain': 'A'}, before)
        self.part('graft_drifted', {**graft, 'domain': 'A'}, drifted)
        for loss in depth_one_losses():
            lr = self.best_lr('heal', loss, p.heal_lr_grid, p.heal_steps, graft, self.heal_arm)
            for seed in seeds:
                key = {**graft, 'loss': loss, 'lr': lr, 'seed': seed, 'steps': p.heal_steps}
                self.part(f'heal_{loss}_s{seed}', key, lambda loss=loss, lr=lr, seed=seed:
                          self.heal_arm(loss, lr, seed, p.heal_steps, final=True)[0])
        for name, domain in (('sft', 'A'), ('sft', 'B'), ('original', 'A')):
            self.release(name, domain)

    def joint_arm(self, loss: str) -> Dict:
        """The SFT of :meth:`fine_tune` with the official head attached and trained together
        with the backbone (``mtp_detach_heads=False``, Megatron's MTP loss scale)."""
        from smollm2_lib import evaluate as E
        from smollm2_lib import heads as H

        p = self.preset
        name = f'joint_{loss}'
        model = self.build(1, loss, joint=True, backbone=self.original, heads=self.official)

        def validation(m):  # the backbone moves: its validation states are recomputed
            windows = self.domains['A'].validation[: p.validation_windows, : 2 * p.context]
            states = H.cache_states(m, windows, 4, f'{name}: validation windows')
            data = E.TeacherForcedSet.build('validation', m, windows, states, p.context)
            return self.validation_summary(m, data, 1)

        curve = self.train_full(model, 'A', p.joint_steps, p.sft_lr, seed=41,
                                validation=validation)
        backbone = self.backbone_of(model)
        sets = self.backbone_sets(name, backbone, 'A', ('tf_test', 'prompts'))
        record = {'scenario': 'joint', 'loss': loss, 'lr': p.sft_lr, 'steps': p.joint_steps,
                  'depths': 1, 'mtp_loss_scaling_factor': p.joint_mtp_scale, 'curve': curve,
                  'final': self.final_eval(model, sets, 1),
                  'main_model': self.main_losses(name, backbone)}
        for key in [k for k in self.sets if k[0] == name]:
            del self.sets[key]  # this backbone is not seen again
        return record

    def run_joint(self, lrs: Dict[str, float]) -> None:
        p = self.preset
        self.official = self.official_head(lrs)
        for loss in ('ce', 'tv'):
            key = {'heads': self.official_key(lrs), 'backbone': 'joint', 'domain': 'A',
                   'loss': loss, 'steps': p.joint_steps, 'lr': p.sft_lr, 'seed': 41,
                   'mtp_loss_scaling_factor': p.joint_mtp_scale}
            self.part(f'joint_{loss}', key, lambda loss=loss: self.joint_arm(loss))

    def run(self) -> Dict[str, Dict]:
        """The scenarios in order of what they decide (a run cut short has the first ones);
        each frees the evaluation sets the next ones do not read."""
        scenarios, seeds = self.preset.scenarios, self.preset.seeds
        lrs = self.run_cold() if 'cold' in scenarios else {}
        self.release('original', 'B', keep=('tf_test', 'train_states'))  # read by sft, chain
        # Healing starts every seed from the same grafted head (a seed orders the windows): its
        # first seed runs with the other scenarios, its further seeds last.
        if 'graft' in scenarios:
            self.run_graft(lrs, seeds[:1])
        if 'joint' in scenarios:
            self.run_joint(lrs)
        if 'chain' in scenarios:
            self.run_chain(lrs)
        if 'graft' in scenarios and len(seeds) > 1:
            self.run_graft(lrs, seeds[1:])
        return self.store.all()
