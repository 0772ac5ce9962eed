"""``python -m megatron.mtp_tv.launch`` runs a script unchanged with the plugin installed, and the
start-up hook installs it in programs one does not launch (``MEGATRON_MTP_TV=1``)."""

import builtins
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import patch_mode

if patch_mode.active():
    pytest.skip('patched trees do not carry the launcher or the hook', allow_module_level=True)

from megatron.mtp_tv import launch, startup_hook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.plugin_only  # patched trees do not carry the launcher or the hook


@pytest.fixture
def calls(monkeypatch):
    """Record install() instead of patching megatron-core, and restore sys.argv / sys.path."""
    seen = []
    import megatron.mtp_tv

    monkeypatch.setattr(megatron.mtp_tv, 'install', lambda: seen.append('install'))
    monkeypatch.setattr(sys, 'argv', list(sys.argv))
    monkeypatch.setattr(sys, 'path', list(sys.path))
    return seen


def _script(tmp_path, body, name='script.py'):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_script_runs_as_main_with_its_argv_and_directory(tmp_path, calls):
    out = tmp_path / 'out.txt'
    script = _script(tmp_path, f"""
        import sys
        import megatron.mtp_tv
        with open({str(out)!r}, 'w') as f:
            f.write(repr((__name__, sys.argv, sys.path[0], __file__)))
        megatron.mtp_tv.install()  # the launcher's install ran before: recorded twice
        sys.exit(3)
    """)
    with pytest.raises(SystemExit) as exc:
        launch.main([str(script), '--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512'])
    assert exc.value.code == 3
    name, argv, path0, file = eval(out.read_text())
    assert name == '__main__'
    assert argv == [str(script), '--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512']
    assert path0 == str(tmp_path)
    assert file == str(script)
    assert calls == ['install', 'install']


def test_symlinked_script_finds_the_modules_next_to_its_target(tmp_path, calls):
    """``python link.py`` puts the linked-to file's directory first on ``sys.path`` (realpath, not
    the link's own directory); the launcher must too, or the script's sibling imports fail."""
    real = tmp_path / 'checkout'
    real.mkdir()
    (real / 'launch_sibling_probe.py').write_text('WHERE = "next to the real script"\n')
    out = tmp_path / 'out.txt'
    _script(real, f"""
        import sys
        import launch_sibling_probe
        with open({str(out)!r}, 'w') as f:
            f.write(repr((sys.path[0], launch_sibling_probe.WHERE)))
    """, name='pretrain_probe.py')
    links = tmp_path / 'links'
    links.mkdir()
    link = links / 'link.py'
    link.symlink_to(real / 'pretrain_probe.py')

    plain = subprocess.run([sys.executable, str(link)], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != startup_hook.ENV})
    assert plain.returncode == 0, plain.stderr
    expected = (str(real), 'next to the real script')
    assert eval(out.read_text()) == expected  # what Python itself does
    out.unlink()
    sys.modules.pop('launch_sibling_probe', None)
    try:
        launch.main([str(link)])
    finally:
        sys.modules.pop('launch_sibling_probe', None)
    assert eval(out.read_text()) == expected
    assert calls == ['install']


def test_exceptions_propagate_unchanged(tmp_path, calls):
    script = _script(tmp_path, """
        class Boom(Exception):
            pass
        raise Boom('from the script')
    """)
    with pytest.raises(Exception, match='from the script') as exc:
        launch.main([str(script)])
    assert type(exc.value).__name__ == 'Boom'
    assert exc.traceback[-1].path == script  # the script's own frame is on top


def test_module_mode_and_bad_invocations(tmp_path, calls, monkeypatch):
    pkg = tmp_path / 'launch_probe_pkg'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    out = tmp_path / 'out.txt'
    (pkg / 'tool.py').write_text(
        f'import sys\nopen({str(out)!r}, "w").write(repr((__name__, sys.argv[1:])))\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    launch.main(['-m', 'launch_probe_pkg.tool', '--x', '1'])
    assert eval(out.read_text()) == ('__main__', ['--x', '1'])
    with pytest.raises(SystemExit, match='no such file'):
        launch.main([str(tmp_path / 'missing.py')])
    with pytest.raises(SystemExit) as exc:
        launch.main([])
    assert exc.value.code == 2


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != startup_hook.ENV}
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in [env.get('PYTHONPATH')] if p])
    env.update(extra)
    return env


@pytest.mark.slow
def test_launcher_end_to_end_flags_reach_megatron_args(tmp_path):
    """A real process: Megatron's own parse_args knows the plugin's flags; the exit code passes.
    (tests/test_args_forwarding.py follows them on into TransformerConfig.)"""
    script = _script(tmp_path, """
        import sys
        from megatron.training.arguments import parse_args
        args = parse_args(ignore_unknown_args=True)
        config_fields = {'mtp_loss_type': args.mtp_loss_type, 'mtp_tv_chunk': args.mtp_tv_chunk}
        print(config_fields)
        sys.exit(3 if config_fields == {'mtp_loss_type': 'tv', 'mtp_tv_chunk': 512} else 4)
    """, name='pretrain_probe.py')
    res = subprocess.run(
        [sys.executable, '-W', 'ignore', '-m', 'megatron.mtp_tv.launch', str(script),
         '--mtp-num-layers', '1', '--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512'],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-4000:]


def _probe(pth_dir, env_value):
    """A fresh process that processes the .pth the way ``site`` does at start-up; prints which
    of the hook, torch and megatron-core got imported, and whether the plugin got installed."""
    code = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(pth_dir)!r})
        hook, deps = 'megatron.mtp_tv.startup_hook', ('torch', 'megatron.core')
        loaded = [m in sys.modules for m in (hook, *deps)]
        installed = hook in sys.modules and sys.modules['megatron.mtp_tv'].is_installed()
        print(*loaded, installed)
    """)
    extra = {} if env_value is None else {startup_hook.ENV: env_value}
    return subprocess.run([sys.executable, '-W', 'ignore', '-c', code], env=_env(**extra),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_startup_hook_line(tmp_path):
    """The .pth line (processed by ``site`` as at interpreter start-up) installs only when asked;
    off and unrecognised values import nothing (``false`` once turned it on), and an
    unrecognised value says so on stderr."""
    (tmp_path / startup_hook.PTH_NAME).write_text(startup_hook.PTH_LINE)
    nothing = ['False'] * 4
    for value in (None, '', '0', 'false', 'False', 'off'):
        off = _probe(tmp_path, value)
        assert off.stdout.split() == nothing, (value, off.stdout, off.stderr[-3000:])
        assert off.stderr == '', (value, off.stderr[-3000:])
    typo = _probe(tmp_path, 'ture')
    assert typo.stdout.split() == nothing, typo.stderr[-3000:]
    assert typo.stderr == startup_hook.UNRECOGNISED_WARNING % 'ture'
    on = _probe(tmp_path, 'TRUE')
    assert on.stdout.split() == ['True'] * 4, on.stderr[-3000:]


@pytest.mark.parametrize('value, expected', [
    (None, 'off'), ('', 'off'), ('0', 'off'), ('false', 'off'), ('False', 'off'), ('NO', 'off'),
    ('off', 'off'), (' 0 ', 'off'),
    ('1', 'on'), ('true', 'on'), ('True', 'on'), ('YES', 'on'), ('on', 'on'), ('On ', 'on'),
    ('2', 'unrecognised'), ('ture', 'unrecognised'), ('enabled', 'unrecognised'),
    ('-1', 'unrecognised'),
])
def test_startup_hook_spellings(value, expected, monkeypatch, capsys):
    """Every spelling, in the .pth line itself (run in this process with ``__import__`` recorded
    instead of installing) and in :func:`startup_hook.state`, which must agree with it."""
    if value is None:
        monkeypatch.delenv(startup_hook.ENV, raising=False)
    else:
        monkeypatch.setenv(startup_hook.ENV, value)
    imported = []

    def recording_import(name, *args, **kwargs):
        if name.startswith('megatron'):
            imported.append(name)
            return None
        return builtins.__import__(name, *args, **kwargs)

    namespace = {'__builtins__': {**vars(builtins), '__import__': recording_import}}
    exec(startup_hook.PTH_LINE, namespace)
    err = capsys.readouterr().err
    assert imported == (['megatron.mtp_tv.startup_hook'] if expected == 'on' else [])
    if expected == 'unrecognised':
        assert repr(value) in err and 'true' in err and 'false' in err, err
        assert err == startup_hook.UNRECOGNISED_WARNING % value
    else:
        assert err == ''
    assert startup_hook.state() == expected
    assert startup_hook.enabled() == (expected == 'on')


def test_setup_py_ships_the_same_pth_line():
    assert (ROOT / startup_hook.PTH_NAME).read_text() == startup_hook.PTH_LINE


def test_startup_hook_cli_writes_and_removes_the_pth(tmp_path, capsys):
    assert startup_hook._cli(['install', '--site-packages', str(tmp_path)]) == 0
    assert (tmp_path / startup_hook.PTH_NAME).read_text() == startup_hook.PTH_LINE
    assert startup_hook.PTH_LINE.startswith('import ')  # site executes only such lines
    startup_hook._cli(['status', '--site-packages', str(tmp_path)])
    assert 'present' in capsys.readouterr().out
    startup_hook._cli(['uninstall', '--site-packages', str(tmp_path)])
    assert not (tmp_path / startup_hook.PTH_NAME).exists()
