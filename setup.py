"""megatron.mtp_tv: acceptance-aware (total variation) losses for Megatron-LM's MTP heads.

`megatron` is a PEP 420 namespace package shared with megatron-core (which ships
`megatron/core` and `megatron/training` and no `megatron/__init__.py`); this distribution adds
`megatron/mtp_tv`. There must be no `megatron/__init__.py` here either.
"""

import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

# The opt-in start-up hook (megatron/mtp_tv/startup_hook.py): one .pth line in site-packages that
# installs the plugin at interpreter start-up only when MEGATRON_MTP_TV=1. Regular installs get
# it here; editable installs run `python -m megatron.mtp_tv.startup_hook install`. The file's
# one line equals startup_hook.PTH_LINE (tests/test_launch.py checks it).
PTH = "megatron_mtp_tv.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


def pinned(name):
    """``name==version`` as requirements.txt (the one place versions are pinned) pins it:
    the plugin is tested with that megatron-core alone, so pip must not pick another."""
    with open(os.path.join(HERE, "requirements.txt")) as f:
        for line in f:
            requirement = line.split("#", 1)[0].strip()
            if requirement.startswith(name + "=="):
                return requirement
    raise RuntimeError(f"requirements.txt pins no {name}")


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(
    name="megatron-mtp-tv",
    version="0.1.0",
    description=(
        "Acceptance-aware (total-variation) training losses for Megatron-LM "
        "Multi-Token Prediction heads"
    ),
    packages=find_namespace_packages(include=["megatron.mtp_tv", "megatron.mtp_tv.*"]),
    python_requires=">=3.12",
    # Exact versions live in requirements.txt; here what the package needs at run time, and the
    # one megatron-core its plugin supports.
    install_requires=["torch", pinned("megatron-core")],
    zip_safe=False,
    cmdclass={"build_py": build_py_with_pth},
)
