"""The examples' Megatron flags parse with Megatron's own parse_args / validate_args and reach
TransformerConfig (plugin mode; under tools/run_patched_suite.py, on the patched 0.19.2 tree).

Each example prints the arguments it would pass with ``PRINT_ARGS=1`` (NUL-separated), so this
checks what the script really passes, not a copy of it.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import megatron.mtp_tv
from mtp_tv_dev.megatron_args import config_from_argv, miles_extra_args_provider

megatron.mtp_tv.install()  # a no-op in patch mode

EXAMPLES = Path(__file__).resolve().parents[1] / 'examples'
pytestmark = pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')


def printed_args(script, **env):
    res = subprocess.run(
        ['bash', str(EXAMPLES / script)], env={**os.environ, **env, 'PRINT_ARGS': '1'},
        capture_output=True, check=True,
    )
    return res.stdout.decode().split('\0')[:-1]


def test_pretrain_gpt_example(monkeypatch):
    argv = printed_args('pretrain_gpt_mtp_tv.sh')
    args, config = config_from_argv(argv, monkeypatch, world_size=8)  # one 8-GPU node
    assert (config.mtp_loss_type, config.mtp_tv_chunk, config.mtp_num_layers) == ('tv', 512, 2)
    assert (config.tensor_model_parallel_size, config.sequence_parallel) == (2, True)
    assert args.data_parallel_size == 4 and args.transformer_impl == 'transformer_engine'


def test_pretrain_gpt_example_with_a_dataset(monkeypatch):
    argv = printed_args('pretrain_gpt_mtp_tv.sh', DATA_PATH='/data/x_text_document',
                        TOKENIZER='/models/tok')
    assert argv[argv.index('--data-path') + 1] == '/data/x_text_document'
    assert '--mock-data' not in argv


# Stand-in for the Qwen3.5-35B-A3B model flags that miles' recipe adds (scripts/models/), reduced
# to what validate_args needs for the layout: a MoE with RoPE.
QWEN_LIKE = [
    '--num-layers', '2', '--hidden-size', '256', '--num-attention-heads', '4',
    '--group-query-attention', '--num-query-groups', '2', '--kv-channels', '64',
    '--seq-length', '256', '--max-position-embeddings', '256', '--position-embedding-type', 'rope',
    '--normalization', 'RMSNorm', '--swiglu', '--disable-bias-linear',
    '--untie-embeddings-and-output-weights', '--num-experts', '8', '--moe-router-topk', '2',
    '--moe-ffn-hidden-size', '128', '--expert-tensor-parallel-size', '1',
    '--micro-batch-size', '1', '--global-batch-size', '16', '--train-iters', '10', '--lr', '1e-6',
    '--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '1024', '--bf16',
]


@pytest.mark.parametrize('layout, tp, cp', [('tp2-cp2-ep8', 2, 2), ('tp1-ep8', 1, 1)])
def test_miles_example(monkeypatch, layout, tp, cp):
    argv = printed_args('miles_qwen3_5_35b_a3b_mtp_tv.sh', PARALLELISM=layout)
    assert argv[-4:] == ['--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512']
    args, config = config_from_argv(
        QWEN_LIKE + argv, monkeypatch, provider=miles_extra_args_provider, world_size=8
    )
    assert args.enable_mtp_training
    assert (config.mtp_loss_type, config.mtp_tv_chunk, config.mtp_num_layers) == ('tv', 512, 1)
    assert config.mtp_loss_scaling_factor == 0.2
    assert (config.tensor_model_parallel_size, config.context_parallel_size) == (tp, cp)
    assert config.expert_model_parallel_size == 8
    assert config.sequence_parallel == (tp > 1)


def test_miles_example_refuses_unknown_layouts():
    res = subprocess.run(['bash', str(EXAMPLES / 'miles_qwen3_5_35b_a3b_mtp_tv.sh')],
                         env={**os.environ, 'PRINT_ARGS': '1', 'PARALLELISM': 'tp8'},
                         capture_output=True, text=True)
    assert res.returncode == 2 and 'PARALLELISM' in res.stderr
