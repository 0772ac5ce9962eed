"""The SmolLM2-135M demo's pieces (``examples/smollm2_demo.py``).

* :mod:`.weights`: the GGUF checkpoint through ``transformers``, mapped into a megatron-core
  ``GPTModel`` with fresh MTP heads;
* :mod:`.data`: the two text domains tokenised with the model's own tokenizer, in
  train / validation / test blocks;
* :mod:`.heads`: cached backbone states and a heads-only training step through the plugin;
* :mod:`.decode`: incremental decoding through a KV cache for the backbone and each MTP depth;
* :mod:`.evaluate`: teacher-forced acceptance over long contexts, the main model's sampled
  continuations, and speculative decoding through the KV cache;
* :mod:`.experiment`: the presets, the scenarios as resumable parts, and their store;
* :mod:`.report`: tables, paired differences, the ranking and the plot, from the stored parts.
"""
