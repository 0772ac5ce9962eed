"""The committed patches in ``patches/`` are what ``tools/make_patches.py`` makes of the current
package source, and they apply.

* megatron-core 0.19.2: regenerated here from the pristine files (the installed distribution
  when it is that release, verified by sha256, else the registry wheel) and compared byte for
  byte; applied with ``git apply`` to those files.
* patches for git commits (radixark/Megatron-LM forks, NVIDIA/Megatron-LM main and dev): without
  the tree, every package file in them must equal the package source, the lines they add to /
  remove from Megatron files must equal what the generator renders for that tree now, and the
  facts recorded for the tree must be ones the package knows. With clones holding the commits
  in ``MTP_TV_MEGATRON_LM`` (``os.pathsep``-separated) they are regenerated and applied too.
* ``make_patches.py --tree``: a patch for any checkout, tested on the 0.19.2 files unpacked from
  the wheel (plain and as a git checkout) and refused, naming the fact, on trees changed beyond
  what the generator knows.
"""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT / 'tools'))  # the generator, tools/patchgen (tools/make_patches.py)

from patchgen import cli, edits, layout, offline, package, render, snippets, sources, targets  # noqa: E402

FORK = os.environ.get('MTP_TV_MEGATRON_LM')
needs_git = pytest.mark.skipif(shutil.which('git') is None, reason='git not installed')


@pytest.mark.parametrize('name', sorted(targets.TARGETS))
def test_committed_patch_matches_package_source(name):
    target = targets.TARGETS[name]
    assert target.patch_path.exists(), f'{target.patch_path} missing: run tools/make_patches.py'
    problems = offline.check_offline(target, target.patch_path.read_text())
    assert not problems, 'stale patch (run python tools/make_patches.py):\n' + '\n'.join(problems)


def test_0192_patch_regenerates_identically():
    target = targets.TARGETS['megatron-core-0.19.2']
    text = render.render_patch(target, sources.files_0192())
    assert text == target.patch_path.read_text(), 'stale: run python tools/make_patches.py'


def _apply(tmp_path, files, patch):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for args in (['--check'], []):
        res = subprocess.run(
            ['git', 'apply', *args, str(patch)], cwd=tmp_path, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr


@needs_git
def test_0192_patch_applies_and_gives_the_generated_tree(tmp_path):
    files = sources.files_0192()
    target = targets.TARGETS['megatron-core-0.19.2']
    _apply(tmp_path, files, target.patch_path)
    for rel, text in edits.patched_files(files).items():
        assert (tmp_path / rel).read_text() == text, rel


@needs_git
@pytest.mark.skipif(not FORK, reason='set MTP_TV_MEGATRON_LM to clones of radixark/Megatron-LM and '
                    'NVIDIA/Megatron-LM (os.pathsep-separated)')
@pytest.mark.parametrize('name', [n for n, t in sorted(targets.TARGETS.items()) if t.commit])
def test_fork_patch_regenerates_and_applies(name, tmp_path):
    target = targets.TARGETS[name]
    files = _fork_files(target)
    assert render.render_patch(target, files) == target.patch_path.read_text()
    _apply(tmp_path, files, target.patch_path)


def _fork_files(target):
    files = sources.pristine_files(target, FORK)
    if files is None:
        pytest.skip(f'no clone in MTP_TV_MEGATRON_LM has {target.repo} {target.commit[:9]}')
    return files


def _change_the_package(monkeypatch, tmp_path, *, config_py=lambda text: text,
                        fields_py=lambda text: text, new_modules=()):
    """Point the generator at a copy of megatron/mtp_tv changed as the package's owners change it:
    ``config_py`` and ``fields_py`` rewrite config.py and fields.py, ``new_modules`` are added
    (empty files of those names)."""
    copy = tmp_path / 'mtp_tv'
    shutil.copytree(package.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns('__pycache__'))
    for name, rewrite in (('config.py', config_py), ('fields.py', fields_py)):
        (copy / name).write_text(rewrite((copy / name).read_text()))
    for name in new_modules:
        (copy / name).write_text('"""New."""\n')
    monkeypatch.setattr(package, 'PACKAGE_DIR', copy)


def _edit_a_field_docstring(text):
    assert 'Training objective' in text.split('# END MTP_TV FIELDS')[0]
    return text.replace('Training objective', 'Objective')


def test_stale_package_file_is_detected(monkeypatch, tmp_path):
    target = targets.TARGETS['miles-main-2e64d788b']
    text = target.patch_path.read_text()
    _change_the_package(monkeypatch, tmp_path, config_py=lambda text: text + '# new\n')
    problems = offline.check_offline(target, text)
    assert any('mtp_tv/config.py: differs' in p for p in problems), problems


def test_stale_field_docstring_is_detected(monkeypatch, tmp_path):
    target = targets.TARGETS['miles-main-20260819-235952df6']
    text = target.patch_path.read_text()
    _change_the_package(monkeypatch, tmp_path, fields_py=_edit_a_field_docstring)
    problems = offline.check_offline(target, text)
    assert any('transformer_config.py: added lines differ' in p for p in problems), problems


def test_shipped_modules_are_relocatable_and_plugin_only_ones_stay_out():
    shipped = package.shipped_modules()
    assert {'__init__.py', 'config.py', 'mtp_loss.py', 'metrics.py', 'sweep.py'} <= set(shipped)
    assert not any(p in package.NOT_SHIPPED for p in shipped)
    assert all('/' not in p for p in shipped)  # the core is flat: no test or demo support inside
    with pytest.raises(layout.PatchError, match='relative imports'):
        package._check_relocatable('x.py', 'from megatron.mtp_tv.config import MTP_LOSS_TYPES\n')


def test_fields_block_is_the_config_dataclass_body():
    from megatron.mtp_tv.fields import MTPLossConfig
    import dataclasses

    block = package.fields_block()
    for f in dataclasses.fields(MTPLossConfig):
        assert f'    {f.name}: ' in block
    assert 'class ' not in block and '@dataclass' not in block


def test_offline_regeneration_equals_full_regeneration(monkeypatch, tmp_path):
    """What `make patches` does for the fork patches without the fork gives the same bytes as a
    regeneration from the tree (shown on 0.19.2, whose pristine files are at hand)."""
    target = targets.TARGETS['megatron-core-0.19.2']
    committed = target.patch_path.read_text()
    files = sources.files_0192()
    _change_the_package(monkeypatch, tmp_path, fields_py=_edit_a_field_docstring,
                        new_modules=['zz_new.py'])
    assert offline.check_offline(target, committed)  # stale now
    assert offline.regenerate_offline(target, committed) == render.render_patch(target, files)


@pytest.mark.skipif(not FORK, reason='set MTP_TV_MEGATRON_LM to clones of radixark/Megatron-LM and '
                    'NVIDIA/Megatron-LM (os.pathsep-separated)')
@pytest.mark.parametrize('name', [n for n, t in sorted(targets.TARGETS.items()) if t.commit])
def test_offline_regeneration_equals_full_regeneration_on_forks(name, monkeypatch, tmp_path):
    target = targets.TARGETS[name]
    files = _fork_files(target)
    committed = target.patch_path.read_text()
    _change_the_package(monkeypatch, tmp_path, fields_py=_edit_a_field_docstring,
                        new_modules=['zz_new.py'])
    assert offline.regenerate_offline(target, committed) == render.render_patch(target, files)


def test_every_config_field_is_in_every_patch():
    """make_patches takes every field of MTPLossConfig (no list of names to keep in step)."""
    from megatron.mtp_tv.config import MTP_LOSS_FIELDS
    from megatron.mtp_tv.fields import MTPLossConfig

    names = [f.name for f in dataclasses.fields(MTPLossConfig)]
    assert package.field_names() == tuple(names)
    assert set(MTP_LOSS_FIELDS) == set(names)  # every field is validated (config.py)
    for name, target in sorted(targets.TARGETS.items()):
        text = target.patch_path.read_text()
        header = text.split('diff --git', 1)[0]
        for field in names:
            assert f'+    {field}: ' in text, (name, field)
            assert f'--{field.replace("_", "-")}' in header, (name, field)


def test_an_already_patched_config_is_refused_whatever_the_field():
    files = sources.files_0192()
    last = package.field_names()[-1]
    text = files[layout.CONFIG_FILE].replace(
        '    mtp_num_layers: Optional[int] = None', f'    {last}: bool = False\n'
        '    mtp_num_layers: Optional[int] = None', 1)
    with pytest.raises(layout.PatchError, match=f'already has {last}: already patched'):
        edits.edit_config(text)


def test_patched_dispatch_asks_the_package_which_code_computes_the_loss():
    """Every patch branches on the loss type with the package's own predicate
    (``runs_megatron_ce``: both cross-entropy names, unless mtp_ce_chunked), never with a
    comparison of its own, and hands every other loss to the shipped ``process_mtp_tv_loss``."""
    from megatron.mtp_tv.config import CROSS_ENTROPY_NAMES, runs_megatron_ce
    from megatron.mtp_tv.fields import MTPLossConfig

    for loss_type in CROSS_ENTROPY_NAMES:
        assert runs_megatron_ce(MTPLossConfig(mtp_loss_type=loss_type))
        assert not runs_megatron_ce(MTPLossConfig(mtp_loss_type=loss_type, mtp_ce_chunked=True))
    assert not runs_megatron_ce(MTPLossConfig(mtp_loss_type='tv'))
    for name, target in sorted(targets.TARGETS.items()):
        text = target.patch_path.read_text()
        added = [line[1:] for path in (layout.MTP_FILE, layout.GPT_FILE)
                 for line in _section(text, path) if line.startswith('+')]
        code = [line.split('#')[0] for line in added]
        assert any('= process_mtp_tv_loss(' in line for line in code), name
        assert any('megatron_ce = runs_megatron_ce(' in line for line in code), name
        assert not any('mtp_loss_type' in line for line in code), name


def _section(text, path):
    """The lines of ``path``'s diff in a patch (hunk headers included)."""
    return text.split(f'diff --git a/{path} b/{path}\n', 1)[1].split('\ndiff --git ', 1)[0].split('\n')


@pytest.mark.parametrize('name', sorted(targets.TARGETS))
def test_every_patch_runs_the_mtp_loss_on_the_main_logits_it_projects(name):
    """In every committed patch, GPTModel._postprocess imports the loss on the main logits
    after the tree's transformer imports, splits the hidden states where that loss applies, and
    attaches it right after each main-head projection; the arguments check is in the MTP block."""
    target = targets.TARGETS[name]
    lines = _section(target.patch_path.read_text(), layout.GPT_FILE)
    i = lines.index('+from megatron.core.transformer.multi_token_prediction import '
                    'MTPLossAutoScaler, mtp_loss_inputs')
    assert lines[i - 1].startswith(' from megatron.core.transformer.'), lines[i - 1]
    assert f'+from {layout.TARGET_MODULE}.mtp_loss import (' in lines[i:i + 3]
    assert sum(l.startswith('+') and 'mtp_tv_drafts = None' in l for l in lines) == 1
    assert sum(l.startswith('+') and 'mtp_loss_follows_main_logits(self' in l for l in lines) == 1
    attached = [j for j, l in enumerate(lines) if l.endswith('if mtp_tv_drafts is not None:  '
                                                             '# mtp_tv: the MTP loss against these main logits')]
    assert len(attached) == len(target.facts.main_logits_projections) > 0
    for j in attached:  # each right after the statement `logits, _ = self.output_layer(...)`
        k = j - 1
        while not lines[k].lstrip(' +').startswith('logits, _ = self.output_layer('):
            assert not lines[k].startswith('+'), lines[k]
            k -= 1


@pytest.mark.parametrize('name', sorted(targets.TARGETS))
def test_the_training_side_hands_the_arguments_to_the_core(name):
    """The patched get_model applies the parsed arguments to the built models' configs, once;
    the training side's module is installed under megatron/training, and nothing under
    megatron/core imports it."""
    text = targets.TARGETS[name].patch_path.read_text()
    added = [l[1:] for l in _section(text, layout.TRAINING_FILE) if l.startswith('+')]
    assert added.count('    apply_mtp_loss_args(model, args)') == 1, added
    assert f'diff --git a/{layout.TRAINING_MODULE_FILE} b/{layout.TRAINING_MODULE_FILE}' in text
    for path in (layout.CONFIG_FILE, layout.MTP_FILE, layout.GPT_FILE):
        assert not any('mtp_tv_args' in l for l in _section(text, path)), path


def _code_strings_and_names(source):
    """Every identifier, attribute and string constant of ``source`` but its docstrings."""
    import ast

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value
        elif isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_the_shipped_core_never_reads_megatron_training():
    """What the patches copy into megatron/core neither imports megatron.training nor reads its
    globals (by name, or through sys.modules), nor knows Megatron-Bridge: the training side
    applies the arguments (megatron/training/mtp_tv_args.py)."""
    for rel, source in package.shipped_modules().items():
        used = [s for s in _code_strings_and_names(source)
                if 'megatron.training' in s or s in ('_GLOBAL_ARGS', 'global_vars', 'mtp_tv_args')
                or 'megatron.bridge' in s or s == 'ModelProviderMixin']
        assert not used, (rel, used)


def _pristine(target):
    return sources.files_0192() if target.commit is None else _fork_files(target)


def _function(tree, cls, name):
    import ast

    body = tree.body if cls is None else next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize('name', sorted(targets.TARGETS))
def test_patched_sources_attach_the_loss_to_the_main_logits_and_check_the_arguments(name):
    """In the patched files: _postprocess starts with no drafts, splits the hidden states in
    place of the MTP loss where that loss runs on the main logits (with the call's own arguments
    otherwise), and attaches it right after every main projection; get_model applies Megatron's
    arguments to its models' configs."""
    import ast

    target = targets.TARGETS[name]
    if target.commit and not FORK:
        pytest.skip('set MTP_TV_MEGATRON_LM to clones holding the fork commits')
    patched = edits.patched_files(_pristine(target))
    gpt = ast.parse(patched[layout.GPT_FILE])
    imported = next(n for n in gpt.body if isinstance(n, ast.ImportFrom)
                    and n.module == f'{layout.TARGET_MODULE}.mtp_loss')
    inline = snippets.INLINE_IMPORTS if target.facts.inline_gpt_loss else ()
    assert [a.name for a in imported.names] == sorted(snippets.GPT_IMPORTS + inline)
    post = _function(gpt, 'GPTModel', '_postprocess')
    assert ast.unparse(post.body[1]) == 'mtp_tv_drafts = None'
    splits = [n for n in ast.walk(post) if isinstance(n, ast.If)
              and ast.unparse(n.test).startswith('mtp_loss_follows_main_logits(self')]
    assert len(splits) == 1
    # inline trees: the main rows reach hidden_states through the branch that replaces Megatron's
    main = 'mtp_tv_hidden_states' if target.facts.inline_gpt_loss else 'hidden_states'
    assert ast.unparse(splits[0].body[0]).startswith(
        f'{main}, mtp_tv_drafts = split_mtp_hidden_states(hidden_states, self.config)')
    if target.facts.inline_gpt_loss:
        assert any(ast.unparse(n).startswith('if mtp_tv_hidden_states is not None:\n    '
                                             'hidden_states = mtp_tv_hidden_states\nelif ')
                   for n in ast.walk(post) if isinstance(n, ast.If))
    attached = 0
    for block in ast.walk(post):
        for field in ('body', 'orelse'):
            statements = getattr(block, field, None)
            if not isinstance(statements, list):  # an expression's body (lambda, if-expression)
                continue
            for statement, after in zip(statements, statements[1:] + [None]):
                if ast.unparse(statement).startswith('logits, _ = self.output_layer('):
                    text = ast.unparse(after)
                    assert text.startswith(
                        'if mtp_tv_drafts is not None:\n'
                        '    mtp_tv_inputs = mtp_loss_inputs(**mtp_tv_kwargs)\n'
                        '    logits = attach_mtp_tv_loss(logits, hidden_states, mtp_tv_drafts, '
                        'mtp_tv_inputs, MTPLossAutoScaler)'), text
                    attached += 1
    assert attached == len(target.facts.main_logits_projections) > 0
    training = ast.parse(patched[layout.TRAINING_FILE])
    get_model = _function(training, None, 'get_model')
    statements = [ast.unparse(n) for n in get_model.body]
    i = statements.index('if not isinstance(model, list):\n    model = [model]')
    assert statements[i + 1:i + 3] == [
        f'from {layout.TRAINING_MODULE} import apply_mtp_loss_args',
        'apply_mtp_loss_args(model, args)']


def test_a_process_mtp_loss_call_not_one_keyword_per_line_is_refused():
    text = sources.files_0192()[layout.GPT_FILE]
    call = '                hidden_states = process_mtp_loss(\n                    hidden_states=hidden_states,'
    assert text.count(call) == 1
    changed = text.replace(call, '                hidden_states = process_mtp_loss(hidden_states,')
    with pytest.raises(layout.PatchError, match='one per line'):
        edits.edit_gpt(changed, targets.TARGETS['megatron-core-0.19.2'].facts)


def test_a_gpt_model_without_postprocess_or_already_patched_is_refused():
    text = sources.files_0192()[layout.GPT_FILE]
    facts = targets.TARGETS['megatron-core-0.19.2'].facts
    with pytest.raises(layout.PatchError, match='GPTModel has no _postprocess'):
        edits.edit_gpt(text.replace('    def _postprocess(', '    def _post_process('), facts)
    with pytest.raises(layout.PatchError, match='already patched'):
        edits.edit_gpt(edits.edit_gpt(text, facts).result(), facts)


def test_recorded_facts_the_package_does_not_know_make_the_patch_stale():
    target = targets.TARGETS['nvidia-dev-d48bd6be0']
    facts = dataclasses.replace(
        target.facts, roll_tensor_params=target.facts.roll_tensor_params + ('halo_width',)
    )
    problems = offline.check_offline(dataclasses.replace(target, facts=facts),
                                target.patch_path.read_text())
    assert any('recorded facts' in p and "'halo_width'" in p for p in problems), problems


# ----------------------------------------------------------------------------------------------
# --tree: a patch for any checkout
# ----------------------------------------------------------------------------------------------


def _write_tree(root: Path, files) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _git(root: Path, *args):
    subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args], cwd=root,
                   check=True, capture_output=True)


def _diffs(text: str) -> str:
    return text[text.index('diff --git'):]


@needs_git
def test_tree_mode_on_the_unpacked_wheel_gives_the_0192_patch(tmp_path):
    tree = _write_tree(tmp_path / 'megatron-core', sources.files_0192())
    out = tmp_path / 'out' / 'mine.patch'
    assert cli.main(['--tree', str(tree), '-o', str(out)]) == 0
    text = out.read_text()
    assert _diffs(text) == _diffs(targets.TARGETS['megatron-core-0.19.2'].patch_path.read_text())
    assert f'megatron-mtp-tv patch for the tree {tree.resolve()}' in text
    for args in (['--check'], []):
        subprocess.run(['git', 'apply', *args, str(out)], cwd=tree, check=True)
    for rel, want in edits.patched_files(sources.files_0192()).items():
        assert (tree / rel).read_text() == want, rel


@needs_git
def test_tree_mode_on_a_git_checkout_names_its_commit(tmp_path, monkeypatch, capsys):
    tree = _write_tree(tmp_path / 'Megatron-LM', sources.files_0192())
    _git(tree, 'init', '-q')
    _git(tree, 'add', '.')
    _git(tree, 'commit', '-q', '-m', 'pristine')
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=tree, capture_output=True,
                            text=True, check=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    assert cli.main(['--tree', str(tree)]) == 0
    out = tmp_path / f'megatron-mtp-tv-{commit[:9]}.patch'
    assert str(out) in capsys.readouterr().out
    assert f'commit {commit}.' in out.read_text()
    # a checkout whose files differ from its HEAD where the patch goes is refused
    mtp_file = tree / layout.MTP_FILE
    mtp_file.write_text(mtp_file.read_text().replace('"""Track the Multi-Token Prediction', '"""X', 1))
    out.unlink()
    assert cli.main(['--tree', str(tree)]) == 2
    assert 'does not apply' in capsys.readouterr().err and not out.exists()


def _changed_0192(path, old, new):
    files = dict(sources.files_0192())
    assert files[path].count(old) == 1, old
    files[path] = files[path].replace(old, new)
    return files


@needs_git
@pytest.mark.parametrize(
    'path,old,new,expected',
    [
        (layout.MTP_FILE, '    input_ids: Optional[Tensor] = None,\n) -> Tensor:',
         '    input_ids: Optional[Tensor] = None,\n    halo_plan=None,\n) -> Tensor:',
         "process_mtp_loss has parameter(s) ['halo_plan'] that the TV losses do not know"),
        (layout.MTP_FILE, 'def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, '
         'packed_seq_params=None):',
         'def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None, '
         'fill_value=0):',
         "has unknown parameter(s) ['fill_value']"),
        (layout.MTP_FILE, '    def save_metrics_to_tracker(', '    def save_stats_to_tracker(',
         "MTPLossLoggingHelper has none of ['save_metrics_to_tracker', 'save_loss_to_tracker']"),
        (layout.MTP_FILE, 'def process_mtp_loss(', 'def compute_mtp_loss(',
         'has no process_mtp_loss'),
    ],
    ids=['process_mtp_loss-parameter', 'roll_tensor-parameter', 'tracker', 'no-mtp-loss'],
)
def test_tree_mode_refuses_a_fact_it_does_not_know(tmp_path, capsys, path, old, new, expected):
    tree = _write_tree(tmp_path / 'tree', _changed_0192(path, old, new))
    out = tmp_path / 'x.patch'
    assert cli.main(['--tree', str(tree), '-o', str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and 'no patch written' in err, err
    assert not out.exists()


@needs_git
def test_tree_mode_refuses_a_gpt_model_without_postprocess(tmp_path, capsys):
    files = _changed_0192(layout.GPT_FILE, '    def _postprocess(', '    def _post_process(')
    tree = _write_tree(tmp_path / 'tree', files)
    out = tmp_path / 'x.patch'
    assert cli.main(['--tree', str(tree), '-o', str(out)]) == 2
    assert 'GPTModel has no _postprocess' in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize('name', sorted(targets.TARGETS))
def test_every_patch_has_its_pull_request_description_up_to_date(name):
    """``patches/<name>.md`` is what the generator renders from the committed patch now: its
    per-file line counts are the patch's, its benchmark rows docs/benchmarks.md's."""
    from patchgen import describe

    target = targets.TARGETS[name]
    text = describe.render_description(target, target.patch_path.read_text())
    assert describe.description_path(target).read_text() == text, (
        'stale: run python tools/make_patches.py')
    added = sum(1 for line in target.patch_path.read_text().split('\n')
                if line.startswith('+') and not line.startswith('+++ '))
    counted = [int(n) for n in re.findall(r'\| \+(\d+) \|', text)]  # the files (the total is bold)
    tests = [int(n) for n in re.findall(r'`tests/unit_tests/[\w/]+\.py` \((\d+) lines\)', text)]
    assert bool(tests) == (not target.facts.inline_gpt_loss)  # shipped where they can run
    assert sum(counted) + int(re.search(r'New files \(\d+, (\d+) lines\)', text).group(1)) + sum(
        tests) == added
