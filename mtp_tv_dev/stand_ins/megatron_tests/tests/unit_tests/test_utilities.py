"""A stand-in for Megatron-LM's ``tests/unit_tests/test_utilities.py`` (its ``Utils``), for trees
that ship without their tests: the megatron-core wheel. Same interface, gloo on CPU, NCCL on CUDA;
the world comes from torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``.

Only ``tools/run_upstream_tests.py`` puts it on a tree; a Megatron-LM checkout has the real one.
"""

import os
from datetime import timedelta

import torch

import megatron.core.parallel_state as ps


class Utils:
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('RANK', '0'))
    inited = False

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', '0')))
            address = os.environ.get('MASTER_ADDR', 'localhost')
            port = os.environ.get('MASTER_PORT', '29500')
            torch.distributed.init_process_group(
                backend='nccl' if torch.cuda.is_available() else 'gloo',
                init_method=f'tcp://{address}:{port}',
                world_size=Utils.world_size,
                rank=Utils.rank,
                timeout=timedelta(minutes=1),
            )
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False
