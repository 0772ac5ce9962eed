"""megatron.mtp_tv: acceptance-aware (total variation) losses for Megatron-LM's MTP heads.

`megatron` is a PEP 420 namespace package shared with megatron-core (which ships
`megatron/core` and `megatron/training` and no `megatron/__init__.py`); this distribution adds
`megatron/mtp_tv`. There must be no `megatron/__init__.py` here either.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-mtp-tv",
    version="0.1.0",
    description=(
        "Acceptance-aware (total-variation) training losses for Megatron-LM "
        "Multi-Token Prediction heads"
    ),
    packages=find_namespace_packages(include=["megatron.mtp_tv", "megatron.mtp_tv.*"]),
    python_requires=">=3.12",
    # Exact versions live in requirements.txt; here only what the package needs at run time.
    install_requires=["torch", "megatron-core"],
    zip_safe=False,
)
