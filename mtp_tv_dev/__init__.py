"""Test and demo support for ``megatron.mtp_tv``: never imported by the product, never installed
with it (``setup.py`` packages ``megatron.mtp_tv`` alone) and never copied by the patches.

* :mod:`.cpu` - shims that let megatron-core 0.19.2 models run on a CPU with gloo.
* :mod:`.distributed` - :func:`spawn` gloo workers with megatron's parallel state, and
  :func:`single_process` for world size 1 in the current process.
* :mod:`.models` - tiny ``GPTModel`` with MTP, its loss, MTP hidden-state capture, and
  tensor-parallel parameter gathering for TP=N vs TP=1 comparisons.
* :mod:`.packed` - packed (THD) ``PackedSeqParams`` and the context-parallel zigzag split.
* :mod:`.bridge` - Megatron-Bridge on a CPU: a Transformer Engine stand-in for its import, the
  local layer and MTP specs, CPU provider settings.
* :mod:`.contiguous` - NVIDIA dev's contiguous packed context-parallel layout (its roll
  context and list-form ``roll_tensor``) for trees that lack it.
* :mod:`.speculative` - the rejection-sampling verifier of the demos' speculative decoding.
* :mod:`.megatron_args` - Megatron's own argument parsing in-process, as ``pretrain_gpt.py`` and
  miles drive it.
* :mod:`.patch_mode` - switch a process to a tree patched with ``patches/`` (tests, tools).

Importable from a checkout (the development install puts the repository root on ``sys.path``).
Importing this package imports torch but not megatron; the submodules import megatron lazily.
"""
