# make demo   - set up .venv (first time: 1-3 min of downloads) and run the CPU demo
# make demo-smollm2 - also the pinned Hugging Face stack, then the SmolLM2-135M experiment (real
#               pretrained model, 49k vocabulary; examples/smollm2_demo.py, docs/smollm2_demo.md);
#               ARGS='--preset long' for every scenario (hours; resumable)
# make test   - set up .venv and run the whole test suite
# make bench  - set up .venv and run the loss benchmark
# make setup  - only create/refresh .venv (tools/setup_env.sh; ~1 s when up to date)
# make setup-hf - also the pinned Hugging Face / Megatron-Bridge stack (requirements-hf.txt)
# make test-patched - the Megatron-facing tests against megatron-core 0.19.2 patched with
#               patches/ instead of the plugin (tools/run_patched_suite.py; part of make test)
# make patches - regenerate patches/ (tools/make_patches.py; the git-tree patches need
#               MTP_TV_MEGATRON_LM=<radixark clone>:<NVIDIA clone> when their base changes)
#
# ARGS="..." is passed to the demo / benchmark script, PYTEST_ARGS="..." to pytest.
# TEST_WORKERS (default: one per core) is pytest-xdist's worker count; 0 runs in one process.
# Test files go one at a time to whichever worker is free (--dist=loadfile), the files with the
# most tests first: a module-scoped fixture (a model load, a benchmark run) is built once.

SHELL := /bin/bash
PY := .venv/bin/python
ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= auto
XDIST := --numprocesses=$(TEST_WORKERS) --dist=loadfile

.PHONY: setup setup-hf demo demo-smollm2 test test-patched patches bench

setup:
	@bash tools/setup_env.sh

setup-hf:
	@bash tools/setup_env.sh hf

demo: setup
	$(PY) examples/cpu_demo.py $(ARGS)

demo-smollm2: setup-hf
	$(PY) examples/smollm2_demo.py $(ARGS)

# pytest exits 5 when it collected no tests; that must fail `make test` (and CI) loudly.
test: setup-hf
	@rc=0; $(PY) -m pytest tests -q -ra --durations=15 $(XDIST) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: ERROR: pytest collected no tests" >&2; fi; \
	exit $$rc
	$(PY) tools/run_patched_suite.py -- $(XDIST)

test-patched: setup
	$(PY) tools/run_patched_suite.py -- $(XDIST)

patches: setup
	$(PY) tools/make_patches.py

bench: setup
	$(PY) tools/bench_loss.py $(ARGS)
