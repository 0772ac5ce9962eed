"""pytest plugin (``-p mtp_tv_dev.megatron_unit_tests``): Megatron-LM's unit tests of the MTP
losses (the file a patch ships, ``tests/unit_tests/transformer/test_mtp_loss_type.py``) on a CPU.

Megatron's ``Utils`` initialises NCCL on a CUDA device; without CUDA this plugin makes it
initialise gloo from torchrun's environment instead, and applies the CPU shims
(:mod:`mtp_tv_dev.cpu`) for the places megatron-core allocates on ``torch.cuda.current_device()``
and for upstream code that assumes Transformer Engine (``no_te_shims``).
With CUDA it changes nothing. ``tools/run_upstream_tests.py`` runs the file with it.
"""

import os
from datetime import timedelta

import torch


def _initialize_gloo():
    from tests.unit_tests.test_utilities import Utils

    if not torch.distributed.is_initialized():
        address = os.environ.get('MASTER_ADDR', 'localhost')
        port = os.environ.get('MASTER_PORT', '29500')
        torch.distributed.init_process_group(
            backend='gloo',
            init_method=f'tcp://{address}:{port}',
            world_size=Utils.world_size,
            rank=Utils.rank,
            timeout=timedelta(minutes=2),
        )
    Utils.inited = True


def _destroy_model_parallel():
    import megatron.core.parallel_state as ps
    from tests.unit_tests.test_utilities import Utils

    if Utils.inited:
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False


def pytest_configure(config):
    if torch.cuda.is_available():
        return
    from tests.unit_tests.test_utilities import Utils

    from mtp_tv_dev.cpu import apply_cpu_shims, no_te_shims, quiet_megatron_warnings

    quiet_megatron_warnings()
    apply_cpu_shims()
    no_te_shims()
    Utils.initialize_distributed = staticmethod(_initialize_gloo)
    Utils.destroy_model_parallel = staticmethod(_destroy_model_parallel)
