"""The pytest side of patch mode (:mod:`mtp_tv_dev.patch_mode` switches the process to the tree):
which tests a patch-mode run keeps, skips and expects to fail."""

from mtp_tv_dev.patch_mode import active, activate, implementation_file  # noqa: F401


#: Tests in other files that only make sense with the plugin (they check the monkey-patching
#: itself); skipped in patch mode. New tests should use ``@pytest.mark.plugin_only`` instead.
PLUGIN_ONLY_TESTS = ()


#: Known differences between the modes, expected to fail in patch mode (strict: once fixed, the
#: XPASS fails the run so the entry gets removed).
PATCH_MODE_XFAIL: dict = {}


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'plugin_only: the test checks plugin mode itself; skipped with MTP_TV_MODE=patch'
    )


#: The losses a patch-mode run keeps of a test parametrised over every loss: one per-depth loss
#: and the per-chain one. The patched tree's loss modules are the checkout's, byte for byte
#: (tests/test_patches.py), and the plugin run covers every loss; patch mode tests the tree's
#: integration, which does not depend on the loss.
PATCH_MODE_LOSSES = ('tv', 'e2e_tv')


def pytest_collection_modifyitems(config, items):
    if not active():
        return
    import pytest

    kept, deselected = [], []
    for item in items:
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        loss = params.get('loss_type')
        (deselected if loss is not None and loss not in PATCH_MODE_LOSSES else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept

    skip = pytest.mark.skip(reason='plugin mode only (MTP_TV_MODE=patch)')
    for item in items:
        nodeid = item.nodeid.split('[')[0]
        if item.get_closest_marker('plugin_only') or nodeid in PLUGIN_ONLY_TESTS:
            item.add_marker(skip)
        elif nodeid in PATCH_MODE_XFAIL:
            item.add_marker(pytest.mark.xfail(reason=PATCH_MODE_XFAIL[nodeid], strict=True))
