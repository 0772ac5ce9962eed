#!/usr/bin/env python3
"""Check that a patched Megatron tree has the MTP TV losses natively and runs them on CPU.

    git -C ~/Megatron-LM apply --check patches/miles-main-2e64d788b.patch   # pick your tree's patch
    git -C ~/Megatron-LM apply patches/miles-main-2e64d788b.patch
    python tools/verify_patched_tree.py ~/Megatron-LM

Everything runs in a child process with only the tree on ``PYTHONPATH`` for Megatron (the plugin
is not installed; ``megatron.mtp_tv`` resolves to the tree's ``megatron.core.transformer.mtp_tv``,
see mtp_tv_dev/patch_mode.py; only the CPU test support comes from this checkout):

1. ``TransformerConfig`` has every field of ``MTPLossConfig`` (fields.py) natively and validates
   them, and the tree's
   ``pyproject.toml`` package list includes ``megatron.core.transformer.mtp_tv`` (so a pip install
   of the patched tree carries it); ``GPTModel._postprocess`` has
   the MTP loss attached to the main logits after every main projection
   (the TV losses' target from the main head's logits);
2. the tree's own ``parse_args``, driven as miles drives it (``extra_args_provider`` resetting
   MTP defaults with miles' ``reset_arg``), knows ``--mtp-loss-type``/``--mtp-tv-chunk`` and
   ``core_transformer_config_from_args`` carries them into the config (skipped with the reason
   if the tree's ``megatron.training`` cannot be imported here, e.g. a missing ``six``);
3. a tiny ``GPTModel`` with 2 MTP depths (local spec, CPU, gloo world of one) runs forward and
   backward with ``mtp_loss_type`` ``'ce'``, ``'tv'`` and ``'e2e_tv'`` through the tree's own MTP
   loss path (``process_mtp_loss``, or ``GPTModel._postprocess`` with
   ``mtp_kwargs={'mtp_labels': tokens}`` on radixark miles-main): the TV path runs (its acceptance
   metrics appear in Megatron's tracker and are logged by ``track_mtp_metrics``), the MTP layers
   get gradients, the main loss is the same for all three, and on trees whose MTP loss detaches
   the output layer (miles-main) the TV loss leaves the output weight's gradient unchanged;
   ``'cross_entropy'`` (upstream's name) gives bit-identical losses, logged values and gradients
   to ``'ce'``.

Upstream code that assumes Transformer Engine is worked around in these processes only, alike
on the patched and the pristine tree (``mtp_tv_dev.cpu.no_te_shims``; reported as ``no_te_shims``).

4. the unit tests the patch ships, where it ships them (``tools/run_upstream_tests.py``: two
   gloo ranks).

With ``--pristine <unpatched checkout of the same commit>``, also: one ``'ce'`` training step gives
bit-identical losses and gradients on the patched and the pristine tree.

Exit status 0 when every check passed. ``--json`` prints the results as JSON.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / 'tools'))
from run_upstream_tests import TEST_FILE as UPSTREAM_TEST_FILE  # noqa: E402
from run_upstream_tests import run as run_upstream_tests  # noqa: E402


def _child(tree: Path) -> dict:
    sys.path.insert(1, str(REPO))  # this checkout's test support, after the tree
    from mtp_tv_dev import patch_mode

    patch_mode.activate()
    from mtp_tv_dev.cpu import no_te_shims

    results = {}
    import torch

    import megatron.core
    import megatron.mtp_tv
    from megatron.core.transformer.transformer_config import TransformerConfig

    results['tree'] = str(tree)
    results['mtp_tv_module'] = megatron.mtp_tv.__file__
    assert Path(megatron.mtp_tv.__file__).resolve().is_relative_to(tree.resolve())
    import dataclasses

    fields = TransformerConfig.__dataclass_fields__
    from megatron.mtp_tv.fields import MTPLossConfig

    names = [f.name for f in dataclasses.fields(MTPLossConfig)]
    assert names and all(f in fields for f in names), (names, 'not all native')
    results['native_fields'] = names
    try:
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, mtp_loss_type='tv')
        raise AssertionError('mtp_loss_type=tv without mtp_num_layers was accepted')
    except ValueError:
        pass
    results['config_fields'] = 'ok'

    results['no_te_shims'] = no_te_shims() or 'none needed'
    results['packaging'] = _check_packaging(tree)
    results['main_logits'] = _check_main_logits()
    results['cli'] = _check_cli()
    results['model'] = _check_model()
    results['mtp_hsm'] = _check_hsm()
    return results


def _check_packaging(tree: Path) -> str:
    """The tree's own setuptools package list (pyproject.toml) includes the new package."""
    pyproject = tree / 'pyproject.toml'
    if not pyproject.exists():
        return 'skipped: no pyproject.toml (an unpacked wheel already is the installed layout)'
    import tomllib

    import setuptools

    find = tomllib.loads(pyproject.read_text())['tool']['setuptools']['packages']['find']
    finder = setuptools.find_namespace_packages if find.get('namespaces', True) else setuptools.find_packages
    packages = finder(where=str(tree), include=find.get('include', ['*']), exclude=find.get('exclude', ()))
    assert 'megatron.core.transformer.mtp_tv' in packages, 'pip install of the tree would drop mtp_tv'
    return 'ok: pyproject.toml packages include megatron.core.transformer.mtp_tv'


def _check_main_logits() -> str:
    """GPTModel._postprocess splits the hidden states where the MTP loss runs on the main
    logits and attaches the tree's loss after every main-head projection."""
    import ast

    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.mtp_tv import mtp_loss

    assert getattr(gpt_model, 'attach_mtp_tv_loss', None) is mtp_loss.attach_mtp_tv_loss, (
        "gpt_model.py does not import the tree's attach_mtp_tv_loss"
    )
    source = ast.parse(Path(gpt_model.__file__).read_text())
    cls = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == 'GPTModel')
    post = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == '_postprocess')
    text = ast.unparse(post)
    projections = text.count('logits, _ = self.output_layer(')
    attached = text.count('logits = attach_mtp_tv_loss(logits, hidden_states, mtp_tv_drafts')
    assert text.count('split_mtp_hidden_states(hidden_states, self.config)') == 1
    assert attached == projections > 0, (attached, projections)
    return (f'ok: GPTModel._postprocess runs the MTP loss on the main logits of its '
            f'{projections} main projection(s)')


def _check_cli():
    try:
        import megatron.training.arguments as arguments
        import megatron.training.argument_utils as argument_utils
    except ImportError as exc:
        return f'skipped: megatron.training does not import here ({exc})'
    # argument_utils in megatron-core 0.19.2, arguments in older trees (radixark miles-main)
    core_transformer_config_from_args = getattr(
        argument_utils, 'core_transformer_config_from_args', None
    ) or getattr(arguments, 'core_transformer_config_from_args')
    sys.argv = [
        'pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', '4',
        '--seq-length', '128', '--max-position-embeddings', '128',
        '--position-embedding-type', 'rope', '--micro-batch-size', '1', '--global-batch-size', '8',
        '--train-iters', '10', '--lr', '1e-4', '--mock-data', '--tokenizer-type', 'NullTokenizer',
        '--vocab-size', '1000', '--enable-mtp-training', '--mtp-num-layers', '1',
        '--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512',
    ]
    os.environ.setdefault('WORLD_SIZE', '1')
    os.environ.setdefault('RANK', '0')
    from mtp_tv_dev.megatron_args import miles_extra_args_provider  # what miles' provider does

    args = arguments.parse_args(extra_args_provider=miles_extra_args_provider)
    if hasattr(arguments, 'get_device_arch_version'):
        arguments.get_device_arch_version = lambda: 9  # no GPU here
    arguments.validate_args(args)
    args.apply_rope_fusion = False  # needs Transformer Engine
    config = core_transformer_config_from_args(args)
    assert (config.mtp_loss_type, config.mtp_tv_chunk) == ('tv', 512), config
    assert args.enable_mtp_training and config.mtp_loss_scaling_factor == 0.2
    # The training side applies the parsed arguments where get_model builds the models: a
    # config that was not built from them, holding another loss, is refused by name.
    import inspect
    import types

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import training
    from megatron.training.mtp_tv_args import apply_mtp_loss_args

    assert 'apply_mtp_loss_args(model, args)' in inspect.getsource(training.get_model)
    by_hand = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, mtp_num_layers=1)
    try:
        apply_mtp_loss_args([types.SimpleNamespace(config=by_hand)], args)
        raise AssertionError("a config holding 'ce' passed the guard of --mtp-loss-type tv")
    except ValueError as exc:
        assert "--mtp-loss-type 'tv'" in str(exc), exc
    return ('ok: --mtp-loss-type tv --mtp-tv-chunk 512 reached TransformerConfig through '
            'parse_args(extra_args_provider=<miles-style reset_arg provider>); get_model applies '
            'the arguments to the configs it builds')


def _check_model():
    import inspect

    import torch

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from mtp_tv_dev.cpu import causal_attention_mask
    from mtp_tv_dev.distributed import single_process
    from mtp_tv_dev.models import build_gpt_with_mtp

    inline = 'mtp_kwargs' in inspect.signature(GPTModel.forward).parameters
    out = {'mtp_loss_path': 'GPTModel._postprocess (inline)' if inline else 'process_mtp_loss'}
    torch.manual_seed(0)
    b, s, vocab = 2, 16, 128
    tokens = torch.randint(0, vocab, (b, s))
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    runs = {}
    # (loss type, MTP loss scale, mtp_log_acceptance)
    cases = (('ce', 0.1, False), ('cross_entropy', 0.1, False), ('ce', 0.1, True),
             ('tv', 0.1, False), ('e2e_tv', 0.1, False), ('tv', 0.0, False))
    for loss_type, scale, log_acceptance in cases:
        with single_process():
            model = build_gpt_with_mtp(
                vocab_size=vocab, seq_length=s, mtp_num_layers=2, mtp_loss_type=loss_type,
                mtp_tv_chunk=8, mtp_loss_scaling_factor=scale, tie_embeddings=False,
                mtp_log_acceptance=log_acceptance,
            )
            model.train()
            kwargs = dict(
                input_ids=tokens, position_ids=position_ids,
                attention_mask=causal_attention_mask(s), labels=labels,
            )
            if inline:
                kwargs['mtp_kwargs'] = {'mtp_labels': tokens}
            loss = model(**kwargs)
            loss.mean().backward()
            tracker = MTPLossLoggingHelper.tracker
            tv_ran = any(str(k).startswith('tv_') for k in tracker)  # the package's own keys
            logged = {}

            class Writer:
                def add_scalar(self, name, value, iteration):
                    logged[name] = float(value)

            MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, Writer())
            mtp_grad = sum(
                float(p.grad.abs().sum()) for n, p in model.named_parameters()
                if n.startswith('mtp.') and p.grad is not None
            )
            runs[(loss_type, scale, log_acceptance)] = dict(
                main_loss=float(loss.mean()), tv_ran=tv_ran, mtp_grad=mtp_grad,
                out_grad=model.output_layer.weight.grad.clone(), logged=logged,
                grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
    ce, tv, e2e, tv0 = (runs[(k, scale, False)]
                        for k, scale in (('ce', 0.1), ('tv', 0.1), ('e2e_tv', 0.1), ('tv', 0.0)))
    assert not ce['tv_ran'] and tv['tv_ran'] and e2e['tv_ran'], 'TV path did not run as expected'
    assert 'mtp_1_tv_acceptance' in tv['logged'] and 'mtp_expected_accepted_drafts' in e2e['logged']
    assert ce['main_loss'] == tv['main_loss'] == e2e['main_loss']
    # upstream's name of the CE loss takes the same code path: bit-identical
    xe = runs[('cross_entropy', 0.1, False)]
    assert not xe['tv_ran'] and xe['main_loss'] == ce['main_loss'] and xe['logged'] == ce['logged']
    assert xe['grads'].keys() == ce['grads'].keys() and all(
        torch.equal(xe['grads'][n], ce['grads'][n]) for n in ce['grads']
    ), "mtp_loss_type='cross_entropy' differs from 'ce'"
    # 'ce' with the acceptance metrics: Megatron's code trains, bit-identical; the metrics are logged
    logging = runs[('ce', 0.1, True)]
    assert logging['tv_ran'] and 'mtp_1_tv_acceptance' in logging['logged']
    assert logging['main_loss'] == ce['main_loss'] and logging['grads'].keys() == ce['grads'].keys()
    assert all(torch.equal(logging['grads'][n], ce['grads'][n]) for n in ce['grads']), (
        "'ce' with mtp_log_acceptance trains differently from 'ce'")
    assert all(logging['logged'][k] == v for k, v in ce['logged'].items())
    assert tv['mtp_grad'] > 0 and e2e['mtp_grad'] > 0 and ce['mtp_grad'] > 0
    detached = torch.equal(tv['out_grad'], tv0['out_grad'])
    if inline:
        assert detached, 'miles-main detaches the output layer from the MTP loss'
    out.update(
        main_loss=ce['main_loss'],
        tv_acceptance={k: v for k, v in tv['logged'].items() if 'tv_acceptance' in k},
        e2e_expected_accepted_drafts=e2e['logged']['mtp_expected_accepted_drafts'],
        mtp_loss_leaves_output_weight_untouched=detached,
        cross_entropy_bit_identical_to_ce=True,
        ce_with_acceptance_metrics_bit_identical_to_ce=True,
    )
    return out


def _check_hsm():
    """NVIDIA main's ``mtp_hsm`` (each depth's input mixed from the main hidden states and the
    earlier depths' outputs) changes what the MTP layers read, not what they hand the loss: every
    loss, its gradient on the hidden states it received and its logged per-depth loss against
    the float64 reference from the equations (``mtp_tv_dev.reference``), in one training step.
    Skipped where the tree has no ``mtp_hsm``."""
    import dataclasses

    import torch

    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.mtp_tv.losses import LOSSES
    from mtp_tv_dev.cpu import causal_attention_mask
    from mtp_tv_dev.distributed import single_process
    from mtp_tv_dev.models import build_gpt_with_mtp, own_projection
    from mtp_tv_dev.reference import depth_terms, objective, per_token_values, shifted_mask

    if 'mtp_hsm' not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        return 'skipped: this tree has no mtp_hsm'
    depth, b, s, vocab, scale = 3, 2, 16, 128, 0.1
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (b, s))
    mask = torch.ones(b, s)
    errors = {}
    for loss_type in LOSSES:
        record = {}
        original = gpt_model.process_mtp_loss

        def recorder(hidden_states, **kwargs):  # the loss's input, its gradient kept
            hidden_states.retain_grad()
            record['hidden'] = hidden_states
            return original(hidden_states=hidden_states, **kwargs)

        with single_process():
            model = build_gpt_with_mtp(
                vocab_size=vocab, seq_length=s, mtp_num_layers=depth, mtp_hsm=True,
                mtp_loss_type=loss_type, mtp_tv_chunk=8, mtp_loss_scaling_factor=scale,
                tie_embeddings=False,
            )
            model.train()
            MTPLossLoggingHelper.tracker.clear()
            gpt_model.process_mtp_loss = recorder
            try:
                with own_projection():  # the loss in process_mtp_loss, where it is recorded
                    loss = model(input_ids=tokens,
                                 position_ids=torch.arange(s).unsqueeze(0).expand(b, s),
                                 attention_mask=causal_attention_mask(s),
                                 labels=torch.roll(tokens, -1, 1), loss_mask=mask)
                    loss.mean().backward()
            finally:
                gpt_model.process_mtp_loss = original
            logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
            hidden = record['hidden'].detach().double().requires_grad_()
            main, *drafts = torch.chunk(hidden, 1 + depth, dim=0)
            weight = model.output_layer.weight.detach().double()
            alpha, kl = depth_terms(main.detach(), drafts, weight)
            masks = torch.stack([shifted_mask(mask, k + 1).t() for k in range(depth)]).double()
            objective(loss_type, alpha, kl, masks, scale).backward()
            per_token = per_token_values(loss_type, alpha, kl).detach()
            ref_logged = (masks * per_token).sum((1, 2)) / masks.sum((1, 2))
        got = record['hidden'].grad[s:].double()
        torch.testing.assert_close(got, hidden.grad[s:], rtol=1e-4, atol=1e-7,
                                   msg=f'mtp_hsm, {loss_type}: gradient')
        torch.testing.assert_close(logged.double(), ref_logged, rtol=1e-5, atol=1e-6,
                                   msg=f'mtp_hsm, {loss_type}: logged mtp loss')
        assert got.abs().sum() > 0, loss_type
        errors[loss_type] = float((got - hidden.grad[s:]).abs().max())
    return {'depths': depth, 'max_grad_error_vs_reference': errors}


def _ce_fingerprint(patched: bool) -> dict:
    """Main loss and every gradient of one 'ce' training step, for the bit-identity check."""
    import inspect

    import torch

    sys.path.insert(1, str(REPO))  # the tree first, this checkout's test support after it
    if patched:
        from mtp_tv_dev import patch_mode

        patch_mode.activate()
    from mtp_tv_dev.cpu import no_te_shims

    no_te_shims()
    from megatron.core.models.gpt import gpt_model
    from megatron.core.models.gpt.gpt_model import GPTModel
    from mtp_tv_dev.cpu import causal_attention_mask
    from mtp_tv_dev.distributed import single_process
    from mtp_tv_dev.models import build_gpt_with_mtp

    root = Path(sys.argv[1]).resolve()
    assert Path(gpt_model.__file__).resolve().is_relative_to(root), gpt_model.__file__
    inline = 'mtp_kwargs' in inspect.signature(GPTModel.forward).parameters
    torch.manual_seed(0)
    b, s, vocab = 2, 16, 128
    tokens = torch.randint(0, vocab, (b, s))
    with single_process():
        model = build_gpt_with_mtp(vocab_size=vocab, seq_length=s, mtp_num_layers=2,
                                   tie_embeddings=False)
        model.train()
        kwargs = dict(input_ids=tokens, position_ids=torch.arange(s).unsqueeze(0).expand(b, s),
                      attention_mask=causal_attention_mask(s), labels=torch.roll(tokens, -1, 1))
        if inline:
            kwargs['mtp_kwargs'] = {'mtp_labels': tokens}
        loss = model(**kwargs)
        loss.mean().backward()
        return {
            'loss': loss.detach().flatten().tolist(),
            'grads': {n: p.grad.flatten().tolist() for n, p in model.named_parameters()
                      if p.grad is not None},
        }


def compare_ce(tree: Path, pristine: Path) -> bool:
    """'ce' on the patched tree is bit-identical to the pristine tree."""
    prints = []
    for root, flag in ((tree, '--child-ce-patched'), (pristine, '--child-ce-pristine')):
        env = {k: v for k, v in os.environ.items() if k != 'MEGATRON_MTP_TV'}
        env.update(MTP_TV_MODE='patch' if root == tree else 'plugin', MTP_TV_TREE=str(tree))
        env['PYTHONPATH'] = os.pathsep.join([str(root)] + [p for p in [env.get('PYTHONPATH')] if p])
        res = subprocess.run([sys.executable, '-W', 'ignore', __file__, str(root), flag],
                             env=env, capture_output=True, text=True, cwd=root)
        lines = [l for l in res.stdout.splitlines() if l.startswith('RESULT ')]
        if res.returncode or not lines:
            print(res.stdout[-3000:] + res.stderr[-5000:], file=sys.stderr)
            return False
        prints.append(json.loads(lines[-1][len('RESULT '):]))
    return prints[0] == prints[1] and len(prints[0]['grads']) > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('tree', type=Path, help='root of a patched Megatron tree')
    parser.add_argument('--json', action='store_true')
    parser.add_argument('--pristine', type=Path,
                        help='an unpatched checkout of the same commit: also check that '
                        "mtp_loss_type='ce' gives bit-identical losses and gradients")
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--child-ce-patched', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--child-ce-pristine', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.child:
        print('RESULT ' + json.dumps(_child(tree)))
        return 0
    if args.child_ce_patched or args.child_ce_pristine:
        print('RESULT ' + json.dumps(_ce_fingerprint(args.child_ce_patched)))
        return 0
    if not (tree / 'megatron/core/transformer/mtp_tv/__init__.py').exists():
        print(f'{tree} is not patched (no megatron/core/transformer/mtp_tv); git apply a patch '
              'from patches/ first', file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != 'MEGATRON_MTP_TV'}
    env.update(MTP_TV_MODE='patch', MTP_TV_TREE=str(tree))
    env['PYTHONPATH'] = os.pathsep.join([str(tree)] + [p for p in [env.get('PYTHONPATH')] if p])
    res = subprocess.run(
        [sys.executable, '-W', 'ignore', __file__, str(tree), '--child'],
        env=env, capture_output=True, text=True, cwd=tree,
    )
    lines = [l for l in res.stdout.splitlines() if l.startswith('RESULT ')]
    if res.returncode or not lines:
        print(res.stdout[-5000:] + res.stderr[-8000:], file=sys.stderr)
        print(f'FAILED on {tree}', file=sys.stderr)
        return 1
    result = json.loads(lines[-1][len('RESULT '):])
    if args.pristine:
        same = compare_ce(tree, args.pristine.resolve())
        result['ce_bit_identical_to_pristine'] = same
        if not same:
            print(f'FAILED: mtp_loss_type=ce differs from {args.pristine}', file=sys.stderr)
            return 1
    if (tree / UPSTREAM_TEST_FILE).exists():  # the unit tests the patch ships, on 2 ranks
        status = run_upstream_tests(tree, quiet=True)
        result['unit_tests'] = 'passed' if status == 0 else f'FAILED (exit {status})'
        if status:
            print(f'FAILED: {UPSTREAM_TEST_FILE} on {tree}', file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f'OK: {tree}')
        for key, value in result.items():
            print(f'  {key}: {value}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
