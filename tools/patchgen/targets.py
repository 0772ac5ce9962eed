"""The shipped patches: one :class:`Target` per pristine tree, with the facts recorded for it.

A wheel target is pinned by the sha256 of the files the patch touches, a git target by commit.
The recorded :class:`~patchgen.facts.Facts` are what the offline check renders the edits from;
a regeneration from the tree re-derives them and fails if they changed.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from .facts import Facts
from .layout import CONFIG_FILE, GPT_FILE, MTP_FILE, PATCH_DIR, TRAINING_FILE


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    facts: Facts
    file_sha256: Dict[str, str] = field(default_factory=dict)  # wheel targets
    commit: Optional[str] = None  # git targets
    repo: str = 'radixark/Megatron-LM'  # where ``commit`` is (git targets)
    patch_file: Optional[Path] = None  # default: patches/<name>.patch

    @property
    def patch_path(self) -> Path:
        return self.patch_file or PATCH_DIR / f'{self.name}.patch'


_UPSTREAM_PARAMS = (
    'hidden_states', 'labels', 'loss_mask', 'output_layer', 'output_weight',
    'runtime_gather_output', 'is_training', 'compute_language_model_loss', 'config', 'cp_group',
    'tp_group', 'packed_seq_params', 'scale_logits_fn', 'input_ids',
)
_MILES_MAIN_PARAMS = (
    'hidden_states', 'labels', 'loss_mask', 'output_layer', 'output_weight',
    'runtime_gather_output', 'is_training', 'compute_language_model_loss', 'config', 'cp_group',
    'packed_seq_params',
)
#: ``_postprocess``'s ``process_mtp_loss(...)`` arguments (``Facts.process_mtp_loss_call``).
_UPSTREAM_CALL = (
    ('hidden_states', 'hidden_states'), ('labels', 'labels'), ('loss_mask', 'loss_mask'),
    ('output_layer', 'self.output_layer'), ('output_weight', 'output_weight'),
    ('runtime_gather_output', 'runtime_gather_output'), ('is_training', 'self.training'),
    ('compute_language_model_loss', 'self.compute_language_model_loss'),
    ('config', 'self.config'), ('cp_group', 'self.pg_collection.cp'), ('tp_group', 'self.tp_group'),
    ('packed_seq_params', 'packed_seq_params'),
    ('scale_logits_fn', 'self._scale_logits if self.config.use_mup else None'),
    ('input_ids', 'input_ids'),
)
#: The same with dev's resolved context-parallel group and roll context.
_DEV_CALL = tuple(
    ('cp_group', 'mtp_cp_group') if k == 'cp_group' else (k, v) for k, v in _UPSTREAM_CALL
    if k != 'scale_logits_fn' and k != 'input_ids'
) + (('sequence_roll_context', 'sequence_roll_context'),) + _UPSTREAM_CALL[-2:]
_ROLL_ONE = ('tensor', 'shifts', 'dims', 'cp_group', 'packed_seq_params')
_ROLL_LIST = (
    'tensors', 'shifts', 'dims', 'cp_group', 'packed_seq_params', 'fill_values', 'roll_context',
    'sequence_fields', 'roll_depth',
)
_TRACKER_METRICS = (
    'save_metrics_to_tracker', 'loss', 'correct', 'total', 'layer_number', 'num_layers',
    'reduce_group', 'avg_group',
)
_TRACKER_LOSS = ('save_loss_to_tracker', 'loss', 'layer_number', 'num_layers', 'reduce_group',
                 'avg_group')

TARGETS: Dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            name='megatron-core-0.19.2',
            description='megatron-core 0.19.2 (the release on the registry; Megatron-LM core_r0.19)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS, inline_gpt_loss=False,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_METRICS,
                postprocess_output_processor=True, main_logits_projections=(8,),
                process_mtp_loss_call=_UPSTREAM_CALL,
            ),
            file_sha256={
                CONFIG_FILE: '3b0843377e6c827b1e2e389edec30392d3c288ab5c58d168167d0c85a26949ee',
                MTP_FILE: '3261d63df93a77493678265d4eb55cac0fc918901537a4076460b2b09d11e5ac',
                GPT_FILE: 'f42663bf44c39273ae4febfac9ce9e567c5d4b31bf60aa3c6df99372eff45cc1',
                TRAINING_FILE: 'd968ef8216f63d6373372190ac895fc905234c116bba3e804d2951876e6ad98c',
            },
        ),
        Target(
            name='miles-main-36ceb4fc0',
            description='radixark/Megatron-LM miles-main at 36ceb4fc0 (base of the seed change)',
            facts=Facts(
                process_mtp_loss_params=None, inline_gpt_loss=True,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_LOSS,
                postprocess_output_processor=False, main_logits_projections=(12, 12),
                flops_tokens='batch_size * args.seq_length', mtp_detach_heads=False,
            ),
            commit='36ceb4fc0462c49e15fd80fd3ef08a852a0672f5',
        ),
        Target(
            name='miles-main-2e64d788b',
            description='radixark/Megatron-LM miles-main at 2e64d788b (branch head when generated)',
            facts=Facts(
                process_mtp_loss_params=_MILES_MAIN_PARAMS, inline_gpt_loss=True,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_LOSS,
                postprocess_output_processor=False, main_logits_projections=(12, 12),
                flops_tokens='batch_size * args.seq_length', mtp_detach_heads=False,
            ),
            commit='2e64d788b67fe8155774200c87606e1e449c494b',
        ),
        Target(
            name='miles-main-20260819-235952df6',
            description='radixark/Megatron-LM miles-main-20260819 at 235952df6 (branch head when '
            'generated)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS + ('sequence_roll_context',),
                inline_gpt_loss=False, roll_tensor_params=_ROLL_LIST, tracker_api=_TRACKER_METRICS,
                postprocess_output_processor=True, main_logits_projections=(12, 12),
                process_mtp_loss_call=_DEV_CALL,
            ),
            commit='235952df607b3820716e5e67728a5ab470ca33ae',
        ),
        Target(
            name='nvidia-main-d98e8a64d',
            description='NVIDIA/Megatron-LM main at d98e8a64d (branch head when generated; '
            'package_info 0.20.0)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS, inline_gpt_loss=False,
                roll_tensor_params=_ROLL_ONE + ('return_sum',), tracker_api=_TRACKER_METRICS,
                postprocess_output_processor=True, main_logits_projections=(8,),
                process_mtp_loss_call=_UPSTREAM_CALL,
            ),
            commit='d98e8a64ddf34856e74b24714e3bedb2f5a39553',
            repo='NVIDIA/Megatron-LM',
        ),
        Target(
            name='nvidia-dev-d48bd6be0',
            description='NVIDIA/Megatron-LM dev at d48bd6be0 (branch head when generated)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS + ('sequence_roll_context',),
                inline_gpt_loss=False, roll_tensor_params=_ROLL_LIST, tracker_api=_TRACKER_METRICS,
                postprocess_output_processor=True, main_logits_projections=(12, 12),
                process_mtp_loss_call=_DEV_CALL,
            ),
            commit='d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1',
            repo='NVIDIA/Megatron-LM',
        ),
    )
}
