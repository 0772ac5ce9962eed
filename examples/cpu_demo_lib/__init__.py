"""Building blocks of ``examples/cpu_demo.py`` (graft-and-heal of MTP draft heads on CPU).

* :mod:`.arms` - the arm names: scenario (warm, serving temperature, cold start) and loss.
* :mod:`.corpus` - the two text domains as byte tokens, held-out split, seeded batches.
* :mod:`.model` - the tiny megatron-core GPTModel with MTP, per-phase configs, freezing, the
  training step through Megatron's loss path, and a no-loss forward for evaluation.
* :mod:`.evaluate` - teacher-forced acceptance and real speculative decoding (T=1, greedy, a
  serving temperature).
* :mod:`.report` - the tables, ``results.json`` and the two plots.

The progress bars are tqdm's (``progress_bar`` in ``examples/cpu_demo.py``).
"""
