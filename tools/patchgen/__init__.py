"""The patch generator: the ``git apply`` patches in ``patches/`` made from the package source.

One command regenerates every patch whose pristine tree it can reach::

    python tools/make_patches.py                                   # all (git targets: offline update)
    python tools/make_patches.py --megatron-lm ~/src/Megatron-LM   # git targets from a clone (repeatable)
    python tools/make_patches.py --check [--megatron-lm ...]       # exit 1 if a patch is stale
    python tools/make_patches.py --tree ~/Megatron-LM [-o x.patch] # a patch for any checkout's HEAD

What a patch does to a Megatron tree (the same changes :mod:`megatron.mtp_tv.plugin` makes at run
time, written into the source so the feature is native there):

* ``megatron/core/transformer/mtp_tv/``: every module of ``megatron/mtp_tv`` except the
  plugin-only ones and the training side's (:data:`NOT_SHIPPED`: ``plugin.py``, ``fields.py``,
  the launcher, the start-up hook, ``training_args.py``), byte for byte but for their ``# BEGIN
  PLUGIN ONLY`` blocks: the package imports itself relatively, so the same files work under both
  names;
* ``transformer_config.py``: the annotated fields between ``# BEGIN MTP_TV FIELDS`` and
  ``# END MTP_TV FIELDS`` of ``megatron/mtp_tv/config.py``, copied verbatim (docstrings included,
  so the tree's ``ArgumentGroupFactory`` makes ``--mtp-loss-type`` & co.) after the tree's last
  ``mtp_*`` field, and ``validate_mtp_loss_config(self)`` at the end of ``__post_init__``;
* ``multi_token_prediction.py``: ``process_mtp_loss`` (where the tree has one) hands every loss
  type but ``'ce'`` (alias ``'cross_entropy'``, upstream's name) to ``process_mtp_tv_loss`` and
  keeps its own code for ``'ce'``;
  ``MTPLossLoggingHelper.track_mtp_metrics`` logs the acceptance metrics first;
* ``gpt_model.py``: where ``mtp_loss_follows_main_logits``, ``GPTModel._postprocess`` only
  splits the hidden states at its ``process_mtp_loss`` call (``split_mtp_hidden_states``) and,
  after each main-head projection, computes the MTP loss on those logits and attaches it to them
  (``attach_mtp_tv_loss``, imported from ``mtp_tv.mtp_loss`` after the tree's last
  ``megatron.core.transformer`` import), so the TV losses take their target from the main head's
  logits; in trees whose MTP loss is inline in ``_postprocess`` (radixark ``miles-main``) the
  same dispatch as above there, fed exactly what the inline ``'ce'`` code uses;
* ``megatron/training/training.py``: ``get_model`` applies the parsed arguments to the built
  models' configs (``apply_mtp_loss_args`` of the new ``megatron/training/mtp_tv_args.py``, this
  package's ``training_args.py``): a Megatron-Bridge provider takes them, any config that holds
  other values stops the run (the core never reads ``megatron.training`` nor knows Bridge).

Pristine sources, always pinned: megatron-core 0.19.2 by the sha256 of the files the patch
touches (read from the installed distribution when it is that release, else from the registry
wheel, itself pinned by sha256); the git targets (radixark/Megatron-LM forks, NVIDIA/Megatron-LM
main and dev) by commit, read with ``git show`` from any clone holding it. No copy of Megatron
code is kept in this repository (the patches' context lines aside).

``--tree``: the facts (:class:`Facts`) are derived from the checkout itself (its HEAD; or the
files on disk of a tree that is not a git checkout), every one is checked against what the
package knows (the literals of ``megatron/mtp_tv/plugin.py``, the checks ``install()`` makes),
and the patch is checked with ``git apply --check`` there; an unknown fact is refused by name.

Staleness without the fork (``--check`` and ``tests/test_patches.py``): every patch is split
into its files; the new package files must equal the package source, and the lines each patch
adds to (and removes from) Megatron files must equal what the generator renders for that tree
from the small record of facts kept per target in :data:`TARGETS` (which parameters its
``process_mtp_loss`` takes, the inline condition it replaces). Regenerating from the fork
re-derives those facts and fails if they no longer match. Without the fork, a stale fork patch
is updated in place (:func:`regenerate_offline`): same bytes as a regeneration from the fork.

Modules, one job each (imports go down this list, never up):

* :mod:`~patchgen.layout`: this repository's paths, the Megatron files a patch touches,
  :class:`~patchgen.layout.PatchError`;
* :mod:`~patchgen.package`: what a patch takes from ``megatron/mtp_tv`` (shipped modules,
  config fields, the plugin's checks), read from its source;
* :mod:`~patchgen.facts`: the :class:`~patchgen.facts.Facts` of a pristine tree, derived and
  checked;
* :mod:`~patchgen.targets`: the shipped patches (:data:`~patchgen.targets.TARGETS`);
* :mod:`~patchgen.sources`: pristine files (the pinned wheel, git objects) and the cache folder;
* :mod:`~patchgen.snippets`: the lines inserted, and the edits each file gets;
* :mod:`~patchgen.edits`: the AST-anchored edits of the pristine files and their diffs;
* :mod:`~patchgen.render`: a whole patch from pristine files;
* :mod:`~patchgen.checkout`: ``--tree``, a patch for any checkout;
* :mod:`~patchgen.offline`: the offline staleness check and regeneration;
* :mod:`~patchgen.cli`: the command line (``tools/make_patches.py`` runs it).
"""
