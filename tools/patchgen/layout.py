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
#: The training side's global arguments: it tells the MTP loss where they are.
GLOBAL_VARS_FILE = 'megatron/training/global_vars.py'
TOUCHED = (CONFIG_FILE, MTP_FILE, GPT_FILE, GLOBAL_VARS_FILE)

#: The condition of the inline MTP loss branch in radixark miles-main's GPTModel._postprocess.
INLINE_CONDITION = "self.config.mtp_num_layers and mtp_kwargs.get('mtp_labels', None) is not None"


class PatchError(RuntimeError):
    """A pristine tree does not look like the generator expects."""
