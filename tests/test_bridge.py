"""Megatron-Bridge providers, and miles' bridge mode, train with the MTP loss that was asked for.

A tiny Hugging Face Llama (random weights, saved locally) goes through Megatron-Bridge's
``AutoBridge.from_hf_pretrained(dir).to_megatron_provider(load_weights=False)``; the provider's
``provide()`` model takes one training step (forward and backward) through the plugin on CPU, and
the per-depth logged loss, the main loss and every gradient are compared with the float64
reference from the equations (``mtp_tv_dev/reference.py``), for the loss type asked for.

* Bridge recipe: the loss type is set on the provider (``cfg.model.mtp_loss_type = 'tv'``).
* miles' bridge mode: Megatron's ``parse_args``/``validate_args`` on a command line with
  ``--mtp-loss-type``, ``set_args``, the provider with miles' fixed list of arguments copied onto
  it, ``finalize()``, then Megatron's ``get_model`` (``provide()``, then the arguments applied to
  the built model's config, ``megatron.mtp_tv.training_args``): the fields reach the provider,
  finalized before ``set_args`` or after; a provider holding another loss stops with a
  ``ValueError``.

CPU stand-ins (test code only, ``mtp_tv_dev/bridge.py``): a Transformer Engine
module for ``megatron.bridge.peft.lora_layers``' import, the local layer and MTP specs,
``AttnBackend.local`` and the fusions off. Versions: ``requirements-hf.txt``.
"""

import pytest
import torch

import megatron.mtp_tv
from mtp_tv_dev.bridge import cpu_provider_settings, import_bridge, local_mtp_block_spec
from mtp_tv_dev.distributed import seed_everything, single_process
from mtp_tv_dev.models import forward_loss
from mtp_tv_dev.megatron_args import miles_extra_args_provider, validated_args
from test_args_forwarding import BASE
from tests.model_reference import mtp_reference_objective, recorded_mtp_hidden

megatron.mtp_tv.install()
AutoBridge = import_bridge().AutoBridge

VOCAB, HIDDEN, SEQ, BATCH, DEPTH = 64, 32, 12, 2, 2

#: The arguments miles copies onto a Bridge provider with the same name, read from
#: radixark/miles miles/backends/megatron_utils/model_provider.py::_apply_bridge_runtime_config
#: at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (names only; the conditional copies there
#: are of arguments that are None in these runs). None of this package's fields is among them.
MILES_COPIED = (
    'tensor_model_parallel_size', 'pipeline_model_parallel_size', 'expert_model_parallel_size',
    'expert_tensor_parallel_size', 'sequence_parallel', 'context_parallel_size',
    'calculate_per_token_loss', 'variable_seq_lengths', 'attention_softmax_in_fp32',
    'fp32_residual_connection', 'deterministic_mode', 'recompute_granularity', 'recompute_method',
    'recompute_num_layers', 'recompute_modules', 'cpu_offloading_num_layers',
    'distribute_saved_activations', 'tp_comm_overlap', 'fp8', 'fp8_recipe', 'attention_backend',
    'moe_token_dispatcher_type',
)


@pytest.fixture(autouse=True)
def _no_attention_backend_env(monkeypatch):
    """Building a model exports ``NVTE_*_ATTN`` for its attention backend and asserts that any
    already set agree: models of other tests (``auto``) leave them at 1, these (``local``) need 0.
    Unset here, restored after."""
    for name in ('NVTE_FLASH_ATTN', 'NVTE_FUSED_ATTN', 'NVTE_UNFUSED_ATTN'):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint (tied embeddings, grouped-query attention, RMSNorm, rope)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp('tiny-llama')
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def set_megatron_args(monkeypatch):
    """``set(argv)``: Megatron's arguments for ``argv`` (miles' extra provider), made global as
    ``set_args`` does (miles' ``init`` calls it before building the model); unset after."""
    import megatron.training.global_vars as global_vars

    def set_(argv):
        args = validated_args(BASE + argv, monkeypatch, provider=miles_extra_args_provider)
        monkeypatch.setattr(global_vars, '_GLOBAL_ARGS', args)
        return args

    return set_


def _provider(hf_dir):
    return AutoBridge.from_hf_pretrained(str(hf_dir)).to_megatron_provider(load_weights=False)


def _on_cpu(provider):
    """The stand-ins for a GPU node, and MTP depths: a tiny Llama checkpoint has none (Bridge
    maps e.g. DeepSeek-V3's ``num_nextn_predict_layers`` to ``mtp_num_layers``)."""
    cpu_provider_settings(provider)
    provider.mtp_num_layers = DEPTH


def _miles_provider(hf_dir, args):
    """miles' bridge mode up to ``finalize()`` (model_provider.py, get_model_provider_func)."""
    provider = _provider(hf_dir)
    for name in MILES_COPIED:  # _apply_bridge_runtime_config
        setattr(provider, name, getattr(args, name))
    _on_cpu(provider)
    provider.finalize()
    return provider


def _get_model(provider, args=None):
    """What Megatron's ``get_model`` does with miles' ``model_provider_func``: the provider's
    ``provide()``, then Megatron's arguments applied to the built model's config (in plugin mode
    its MTP block took them already)."""
    from megatron.mtp_tv.training_args import apply_mtp_loss_args

    with local_mtp_block_spec():
        model = provider.provide(pre_process=True, post_process=True)
    if args is not None:
        apply_mtp_loss_args([model], args)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _train_step(provider, reference_loss=None, args=None):
    """One forward and backward of the model ``get_model`` builds from ``provider``:
    ``(main, grads, logged)``.

    With ``reference_loss`` the MTP objective is the float64 reference for that loss type
    (from the recorded MTP hidden states) instead of the package's.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    with single_process():
        seed_everything(1234)  # the same weights in both runs
        model = _get_model(provider, args)
        tokens, labels, mask = _batch()
        MTPLossLoggingHelper.tracker.clear()
        if reference_loss is None:
            loss = forward_loss(model, tokens, labels, mask)
            main = (loss * mask).sum() / mask.sum()
            main.backward()
            logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
        else:
            with recorded_mtp_hidden() as record:
                loss = forward_loss(model, tokens, labels, mask)
            main = (loss * mask).sum() / mask.sum()
            mtp, _, _, logged = mtp_reference_objective(
                record['hidden'], DEPTH, model.shared_embedding_or_output_weight(), mask,
                reference_loss, provider.mtp_loss_scaling_factor,
                temperature=provider.mtp_tv_temperature, eta=provider.mtp_lk_eta,
            )
            (main + mtp).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return main.detach(), grads, logged


def _assert_matches_reference(provider, loss_type, args=None):
    main, grads, logged = _train_step(provider, args=args)
    ref_main, ref_grads, ref_logged = _train_step(provider, reference_loss=loss_type, args=args)
    torch.testing.assert_close(main, ref_main)
    torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)  # mtp_{k} loss
    assert grads.keys() == ref_grads.keys() and any('mtp.layers' in n for n in grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize('loss_type,settings', [
    ('tv', {}),
    ('e2e_tv', {'mtp_tv_chunk': 5, 'mtp_tv_temperature': 0.8}),
])
def test_bridge_recipe_provider_trains_with_the_loss_set_on_it(hf_dir, loss_type, settings):
    provider = _provider(hf_dir)
    _on_cpu(provider)
    provider.mtp_loss_type = loss_type  # cfg.model.mtp_loss_type = ... in a Bridge recipe
    for name, value in settings.items():
        setattr(provider, name, value)
    provider.finalize()
    assert provider.mtp_loss_type == loss_type
    _assert_matches_reference(provider, loss_type)


@pytest.mark.parametrize('loss_type,flags', [
    ('tv', []),
    ('kl', ['--mtp-tv-temperature', '0.7', '--mtp-tv-chunk', '5']),
])
def test_miles_bridge_mode_trains_with_the_loss_on_the_command_line(
    hf_dir, set_megatron_args, loss_type, flags
):
    args = set_megatron_args(
        ['--mtp-num-layers', str(DEPTH), '--mtp-loss-type', loss_type, *flags]
    )
    provider = _miles_provider(hf_dir, args)
    _assert_matches_reference(provider, loss_type, args)
    assert provider.mtp_loss_type == loss_type  # taken from the arguments
    assert (provider.mtp_tv_temperature, provider.mtp_tv_chunk) == (
        args.mtp_tv_temperature, args.mtp_tv_chunk
    )


def test_miles_bridge_mode_with_a_provider_finalized_before_set_args_takes_them_at_get_model(
    hf_dir, set_megatron_args, monkeypatch
):
    import megatron.training.global_vars as global_vars

    args = set_megatron_args(['--mtp-num-layers', str(DEPTH), '--mtp-loss-type', 'tv'])
    monkeypatch.setattr(global_vars, '_GLOBAL_ARGS', None)
    provider = _miles_provider(hf_dir, args)  # finalized before set_args: nothing to take
    assert provider.mtp_loss_type == 'ce'
    monkeypatch.setattr(global_vars, '_GLOBAL_ARGS', args)
    with single_process():
        _get_model(provider, args)
    assert provider.mtp_loss_type == 'tv'


def test_arguments_at_their_defaults_leave_the_provider_alone(hf_dir, set_megatron_args):
    args = set_megatron_args(['--mtp-num-layers', str(DEPTH)])
    provider = _provider(hf_dir)
    _on_cpu(provider)
    provider.mtp_loss_type = 'e2e_tv'
    provider.finalize()
    with single_process():
        _get_model(provider, args)
    assert provider.mtp_loss_type == 'e2e_tv'


def test_provider_and_arguments_asking_for_different_losses_stop_the_model(
    hf_dir, set_megatron_args
):
    args = set_megatron_args(['--mtp-num-layers', str(DEPTH), '--mtp-loss-type', 'tv'])
    provider = _provider(hf_dir)
    _on_cpu(provider)
    provider.mtp_loss_type = 'kl'
    # plugin mode: at finalize(); a patched tree: at get_model
    with single_process(), pytest.raises(
            ValueError, match=r"GPTModelProvider.mtp_loss_type='kl'.*--mtp-loss-type 'tv'"):
        provider.finalize()
        _get_model(provider, args)


@pytest.mark.parametrize('field,value,message', [
    ('mtp_loss_type', 'TV', r"mtp_loss_type='TV' is not supported"),
    ('mtp_tv_temperature', 0.0, r'mtp_tv_temperature=0.0 is invalid'),
])
def test_finalize_validates_the_fields(hf_dir, field, value, message):
    provider = _provider(hf_dir)
    _on_cpu(provider)
    provider.mtp_loss_type = 'tv'
    setattr(provider, field, value)
    with pytest.raises(ValueError, match=message):
        provider.finalize()


def test_tv_without_mtp_layers_stops_finalize(hf_dir):
    provider = _provider(hf_dir)  # a checkpoint without MTP layers
    cpu_provider_settings(provider)
    provider.mtp_loss_type = 'tv'
    with pytest.raises(ValueError, match=r"mtp_num_layers=None"):
        provider.finalize()
