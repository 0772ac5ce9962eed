"""The loss benchmark: the MTP TV losses against Megatron's cross-entropy, CPU fp32, side by side.

Three groups of rows, each TV row measured in the same run as (and interleaved with) its
cross-entropy baseline, so that the ratios survive a noisy machine:

``loss``  per-depth TV (``linear_tv_loss``, G=1, chunked) vs ``logits = hidden @ W^T`` followed
          by Megatron's ``vocab_parallel_cross_entropy``, same hidden states and weight; fused and
          recompute TV. Reports fwd+bwd time, peak extra memory and bytes saved for backward.
``mtp``   Megatron's own MTP path: ``process_mtp_loss`` through the installed plugin dispatcher
          with ``mtp_loss_type`` 'ce' / 'tv' / 'e2e_tv' (and, with one depth, 'kl', 'lk', 'nla' and
          'tv' at the automatic default chunk, ``tv-auto``), a real ``ColumnParallelLinear``
          output layer and a stand-in for ``GPTModel.compute_language_model_loss``.
``tp``    the ``loss`` rows with the vocabulary sharded over two gloo processes (TP=2).

Time is the median of ``--repeats`` fwd+bwd runs (after ``--warmup``); memory and saved bytes
come from one extra untimed run under :mod:`~lossbench.memory`'s instruments. Targets are printed
with PASS/MISS as measured, never adjusted.

Modules (imports go down this list): :mod:`~lossbench.memory` (the CPU memory instruments),
:mod:`~lossbench.cases` (what is measured), :mod:`~lossbench.timing` (interleaved timing and the
memory run), :mod:`~lossbench.runs` (each row group, TP=2 in gloo processes),
:mod:`~lossbench.report` (targets, summaries, the Markdown table), :mod:`~lossbench.cli` (the
command line of ``tools/bench_loss.py``).
"""
