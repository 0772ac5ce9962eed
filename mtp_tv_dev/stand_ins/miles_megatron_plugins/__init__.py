"""A stand-in for radixark's private ``miles_megatron_plugins`` (true on-policy mode), for
``tools/verify_patched_tree.py`` on the two ``miles-main`` trees that import it: every name its
modules are asked for is off (falsy, callable, iterable as empty). Put
``mtp_tv_dev/stand_ins`` on ``PYTHONPATH`` to use it; never on a real miles run."""
