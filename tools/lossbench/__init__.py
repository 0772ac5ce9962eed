"""The loss benchmark: the MTP TV losses against Megatron's cross-entropy, CPU fp32, side by side.

Five groups of rows (``--cases``; ``loss,mtp,tp`` by default), each TV row measured in the same
run as (and interleaved with) its cross-entropy baseline, so that the ratios survive a noisy
machine:

``loss``  per-depth TV (``linear_tv_loss``, G=1, chunked) vs ``logits = hidden @ W^T`` followed
          by Megatron's ``vocab_parallel_cross_entropy``, same hidden states and weight. Reports fwd+bwd time, peak extra memory and bytes saved for backward.
``mtp``   Megatron's own MTP path: ``process_mtp_loss`` through the installed plugin dispatcher
          with ``mtp_loss_type`` 'ce' / 'tv' / 'e2e_tv' (and, with one depth, 'kl', 'lk', 'nla' and
          'tv' at the automatic default chunk, ``tv-auto``), a real ``ColumnParallelLinear``
          output layer and a stand-in for ``GPTModel.compute_language_model_loss``.
``tp``    the ``loss`` rows with the vocabulary sharded over two gloo processes (TP=2).
``step``  what a user pays past the decoder: ``GPTModel._postprocess`` fwd+bwd (MTP layers, MTP
          loss, main logits, main CE) of a real megatron-core GPTModel with ``mtp_num_layers=G``
          (``--step-depths``), 'ce' vs 'tv', 'kl', 'lk' (and 'e2e_tv' when G > 1) on one model,
          with each row's matrix-products floor (:func:`~lossbench.report.products_floor`: the
          TV losses' own target projection, or none once they reuse the main logits).
``wide``  the ``mtp`` path (G=1, automatic chunk) at large hidden sizes (``--wide-hidden``,
          4096 and 7168) and a 16k vocabulary shard: 'ce', 'tv', 'kl'; peak held to CE's.

The loss code measured is this checkout's package through ``install()`` (plugin mode), or, with
a patched megatron-core tree first on ``PYTHONPATH`` (``megatron.core.transformer.mtp_tv``
importable), the tree's own code, without ``install()`` (patch mode); the report says which.

Time is the median of ``--repeats`` fwd+bwd runs (after ``--warmup``); memory and saved bytes
come from one extra untimed run under :mod:`~lossbench.memory`'s instruments. Targets
(:mod:`~lossbench.report`) are printed with PASS/MISS as measured, never adjusted: ``loss`` TV
<= 1.35x; ``mtp`` 'tv' / 'kl' / 'lk' <= 1.10x at 4096 and 8192 tokens,
'e2e_tv' with 3 depths <= 1.0x, 'nla' <= 1.4x, each with peak <= CE's (the own target: reference);
``tp`` ratio <= 1.25x the TP=1 ratio; ``step`` <= 1.03x and peak <= CE's; ``wide`` peak <= CE's.

Modules (imports go down this list): :mod:`~lossbench.memory` (the CPU memory instruments),
:mod:`~lossbench.cases` (what is measured, and the CE baseline of every benchmark,
:func:`~lossbench.cases.ce_baseline`), :mod:`~lossbench.timing` (the timing harness of every
benchmark, CPU and CUDA, ``tools/gpu_check.py`` and ``tools/bench_row_ops.py`` included, and the
memory run), :mod:`~lossbench.runs` (each row group, TP=2 in gloo processes),
:mod:`~lossbench.report` (targets, summaries, the Markdown table), :mod:`~lossbench.cli` (the
command line of ``tools/bench_loss.py``).
"""
