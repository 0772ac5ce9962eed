"""Where things are: this repository's paths, and the Megatron files a patch touches.

Every module of the generator takes its paths from here, so that a tree's layout is written down
once. :class:`PatchError` is the one error the generator raises for a tree (or package source)
that does not look as it expects.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / 'patches'

#: Where the package lives in a patched tree (next to multi_token_prediction.py).
TARGET_PACKAGE = 'megatron/core/transformer/mtp_tv'
TARGET_MODULE = TARGET_PACKAGE.replace('/', '.')

CONFIG_FILE = 'megatron/core/transformer/transformer_config.py'
MTP_FILE = 'megatron/core/transformer/multi_token_prediction.py'
GPT_FILE = 'megatron/core/models/gpt/gpt_model.py'
#: The training side's ``get_model``: it applies Megatron's arguments to the built models' configs.
TRAINING_FILE = 'megatron/training/training.py'
TOUCHED = (CONFIG_FILE, MTP_FILE, GPT_FILE, TRAINING_FILE)
#: Where the training side's module (megatron/mtp_tv/training_args.py) goes in a patched tree.
TRAINING_MODULE_FILE = 'megatron/training/mtp_tv_args.py'
TRAINING_MODULE = TRAINING_MODULE_FILE[:-3].replace('/', '.')

#: The condition of the inline MTP loss branch in radixark miles-main's GPTModel._postprocess.
INLINE_CONDITION = "self.config.mtp_num_layers and mtp_kwargs.get('mtp_labels', None) is not None"


class PatchError(RuntimeError):
    """A pristine tree does not look like the generator expects."""
