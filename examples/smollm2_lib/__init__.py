"""The SmolLM2-135M demo's pieces (``examples/smollm2_demo.py``).

* :mod:`.weights`: the GGUF checkpoint through ``transformers``, mapped into a megatron-core
  ``GPTModel`` with fresh MTP heads;
* :mod:`.data`: the two text domains tokenised with the model's own tokenizer;
* :mod:`.heads`: cached backbone states and a heads-only training step through the plugin;
* :mod:`.evaluate`: teacher-forced acceptance and speculative decoding on cached states;
* :mod:`.report`: tables, results and plots (on top of ``cpu_demo_lib.report``).
"""
