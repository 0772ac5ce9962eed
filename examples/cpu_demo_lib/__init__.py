"""Building blocks of ``examples/cpu_demo.py`` (graft-and-heal of MTP draft heads on CPU).

* :mod:`.corpus` - the two text domains as byte tokens, held-out split, seeded batches.
* :mod:`.model` - the tiny megatron-core GPTModel with MTP, per-phase configs, freezing, the
  training step through Megatron's loss path, and a no-loss forward for evaluation.
* :mod:`.evaluate` - teacher-forced acceptance and real speculative decoding.
* :mod:`.report` - the table, ``results.json`` and the plot.
* :mod:`.progress` - a dependency-free progress bar.
"""
