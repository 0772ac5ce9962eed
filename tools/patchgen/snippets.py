"""The lines a patch inserts into Megatron files (functions of the package source and of a
target's :class:`~patchgen.facts.Facts` only), and the edits each touched file gets.
"""

from typing import Dict, List, Sequence, Tuple

from .facts import Facts
from .layout import (
    CONFIG_FILE, GPT_FILE, INLINE_CONDITION, MTP_FILE, TARGET_MODULE, TRAINING_FILE, TRAINING_MODULE,
)

from .package import fields_block, tv_loss_params

#: Where the MTP losses' entry points are (megatron/mtp_tv/mtp_loss.py), and what
#: ``GPTModel._postprocess`` imports from there (the inline loss also ``INLINE_IMPORTS``).
MTP_LOSS_MODULE = f'{TARGET_MODULE}.mtp_loss'
GPT_IMPORTS = ('attach_mtp_tv_loss', 'mtp_loss_follows_main_logits', 'split_mtp_hidden_states')
INLINE_IMPORTS = ('process_mtp_tv_loss',)
#: ... and from megatron/mtp_tv/config.py.
INLINE_CONFIG_IMPORTS = ('runs_megatron_ce',)
#: What gpt_model.py imports from multi_token_prediction.py for the MTP losses.
MTP_MODULE = 'megatron.core.transformer.multi_token_prediction'
GPT_MTP_IMPORTS = ('MTPLossAutoScaler', 'mtp_loss_inputs')
#: The local of the patched ``_postprocess`` that holds the drafts' hidden states, split off
#: for the MTP loss on the main logits (None otherwise).
DRAFTS_VAR = 'mtp_tv_drafts'
#: The local that holds the MTP loss's keyword arguments (``process_mtp_loss``'s but the hidden
#: states), for both places the loss can run.
KWARGS_VAR = 'mtp_tv_kwargs'
#: The local of the patched inline branch (radixark miles-main) that holds the main hidden
#: states with the MTP loss attached: None where Megatron's own code computes it (``'ce'``).
HIDDEN_VAR = 'mtp_tv_hidden_states'
#: The indentation of ``_postprocess``'s ``hidden_states = process_mtp_loss(...)`` statement,
#: and of that call's keyword arguments (one per line).
CALL_INDENT = ' ' * 16
CALL_KWARG_INDENT = CALL_INDENT + ' ' * 4

def snippet_fields() -> List[str]:
    return [
        '',
        '    # MTP loss settings (validated in __post_init__ by megatron/core/transformer/mtp_tv).',
        '',
    ] + fields_block().rstrip('\n').split('\n')


def snippet_config_import() -> List[str]:
    return [f'from {TARGET_MODULE}.config import validate_mtp_loss_config']


def snippet_validate() -> List[str]:
    return [
        '',
        '        # MTP loss settings (the mtp_tv fields above).',
        '        validate_mtp_loss_config(self)',
    ]


def snippet_get_model() -> List[str]:
    """In ``get_model``, once the model chunks are a list: their configs hold the MTP loss
    settings Megatron's arguments ask for (a Megatron-Bridge provider takes them here)."""
    return [
        '',
        "    # mtp_tv: the model's config holds the MTP loss settings the arguments ask for, or a",
        "    # ValueError (never a silent 'ce'); a Megatron-Bridge provider takes them here.",
        f'    from {TRAINING_MODULE} import apply_mtp_loss_args',
        '',
        '    apply_mtp_loss_args(model, args)',
    ]


def snippet_flops_import() -> List[str]:
    """At the top of ``num_floating_point_operations``: the MTP loss's own count."""
    return [
        "    # mtp_tv: the MTP loss's forward-only logit projections, beyond the 1 + mtp_num_layers",
        '    # projections (with backward) counted below.',
        f'    from {TRAINING_MODULE} import mtp_loss_flops',
        '',
    ]


#: The indentation of ``num_floating_point_operations``' two top-level ``return`` statements.
FLOPS_RETURN_INDENT = ' ' * 8


def snippet_flops_return(called: str, hybrid_model: bool, tokens: str) -> Tuple[List[str], List[str]]:
    """``(new lines, removed line)`` of the ``return`` that calls ``called`` (``hybrid_flops`` or
    ``transformer_flops``): the MTP loss's count added to it."""
    ind = FLOPS_RETURN_INDENT
    if called == 'hybrid_flops':  # a multi-line call: only its first line changes
        removed = f'{ind}return hybrid_flops('
        return [f'{ind}return mtp_loss_flops(args, {tokens}, hybrid_model={hybrid_model}) + '
                'hybrid_flops('], [removed]
    removed = f'{ind}return {called}()'
    return [
        f'{ind}return mtp_loss_flops(',
        f'{ind}    args, {tokens}, hybrid_model={hybrid_model}',
        f'{ind}) + {called}()',
    ], [removed]


def snippet_flops_edits(tokens: str) -> List[Tuple[List[str], List[str]]]:
    """Every edit of ``num_floating_point_operations``, in file order (the hybrid branch first)."""
    from .facts import FLOPS_RETURNS

    return [(snippet_flops_import(), [])] + [
        snippet_flops_return(called, hybrid, tokens) for called, hybrid in FLOPS_RETURNS.items()
    ]


def snippet_mtp_imports() -> List[str]:
    """multi_token_prediction.py's imports of the MTP losses (after its transformer imports)."""
    return [
        f'from {TARGET_MODULE}.config import runs_megatron_ce',
        f'from {TARGET_MODULE}.metrics import log_acceptance_metrics',
        f'from {TARGET_MODULE}.mtp_loss import MTPLossInputs, process_mtp_tv_loss',
    ]


def _keyword_lines(names: Sequence[str], indent: str) -> List[str]:
    return [f'{indent}{name}={name},' for name in names]


def snippet_process_mtp_loss(params: Sequence[str]) -> List[str]:
    """First in ``process_mtp_loss``: the branch of every MTP loss but Megatron's own ``'ce'``."""
    inputs = [p for p in params if p != 'hidden_states']
    return [
        "    # mtp_tv: every MTP loss but Megatron's own 'ce', which the code below computes (its",
        '    # acceptance metrics logged here first with mtp_log_acceptance).',
        '    megatron_ce = runs_megatron_ce(config)',
        '    if not megatron_ce or (is_training and config.mtp_log_acceptance):',
        '        main_hidden_states, mtp_loss = process_mtp_tv_loss(',
        '            hidden_states,',
        '            mtp_loss_inputs(',
        *_keyword_lines(inputs, ' ' * 16),
        '            ),',
        '        )',
        '        if not megatron_ce:',
        '            if mtp_loss is None:  # no labels',
        '                return main_hidden_states',
        '            return MTPLossAutoScaler.apply(main_hidden_states, mtp_loss)',
        '',
    ]


#: ``mtp_loss_inputs``' parameters in a tree without ``process_mtp_loss`` (radixark miles-main
#: at 36ceb4fc0): those of the inline branch.
INLINE_PARAMS = (
    'labels', 'loss_mask', 'output_layer', 'output_weight', 'runtime_gather_output',
    'is_training', 'compute_language_model_loss', 'config', 'cp_group', 'packed_seq_params',
    'input_ids',
)
#: Parameters of ``mtp_loss_inputs`` that ``MTPLossInputs`` does not take.
_UNUSED_INPUTS = ('runtime_gather_output', 'compute_language_model_loss', 'sequence_roll_context')


def mtp_loss_inputs_params(facts: Facts) -> Tuple[str, ...]:
    """``mtp_loss_inputs``' parameters: ``process_mtp_loss``'s but ``hidden_states``, and the
    input ids the inline branch passes."""
    if facts.process_mtp_loss_params is None:
        return INLINE_PARAMS
    params = tuple(p for p in facts.process_mtp_loss_params if p != 'hidden_states')
    if facts.inline_gpt_loss and 'input_ids' not in params:
        params += ('input_ids',)
    return params


def _roll_body(facts: Facts) -> List[str]:
    pad = ' ' * 8
    if facts.roll_tensor_params[0] == 'tensors':  # NVIDIA dev's list form, with its context
        context = 'sequence_roll_context' in mtp_loss_inputs_params(facts)
        return [
            *([f'{pad}context = (',
               f'{pad}    {{}}',
               f'{pad}    if sequence_roll_context is None',
               f'{pad}    else dict(',
               f'{pad}        roll_context=sequence_roll_context,',
               f'{pad}        sequence_fields=[field],',
               f'{pad}        roll_depth=depth,',
               f'{pad}    )',
               f'{pad})'] if context else []),
            f'{pad}(rolled,) = roll_tensor(',
            f'{pad}    [tensor],',
            f'{pad}    shifts=-1,',
            f'{pad}    dims=-1,',
            f'{pad}    cp_group=cp_group,',
            f'{pad}    packed_seq_params=packed_seq_params,',
            *([f'{pad}    **context,'] if context else []),
            f'{pad})',
            f'{pad}return rolled, rolled.sum()',
        ]
    return [
        f'{pad}return roll_tensor(',
        f'{pad}    tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params',
        f'{pad})',
    ]


def _record_body(facts: Facts) -> List[str]:
    pad = ' ' * 8
    if facts.tracker_api[0] == 'save_metrics_to_tracker':
        return [
            f'{pad}MTPLossLoggingHelper.save_metrics_to_tracker(',
            f'{pad}    loss, correct, count, layer_number, num_layers, avg_group=avg_group',
            f'{pad})',
        ]
    return [  # no greedy accuracy in this tree's tracker
        f'{pad}MTPLossLoggingHelper.save_loss_to_tracker(',
        f'{pad}    loss, layer_number, num_layers, avg_group=avg_group',
        f'{pad})',
    ]


def snippet_mtp_loss_inputs(facts: Facts) -> List[str]:
    """At the end of multi_token_prediction.py: ``process_mtp_loss``'s arguments as the MTP
    losses take them, with this tree's ``roll_tensor`` and tracker (all a tree's own forms)."""
    params = mtp_loss_inputs_params(facts)
    required = 8  # labels .. config: every tree passes them
    signature = [f'    {p},' for p in params[:required]] + [f'    {p}=None,' for p in params[required:]]
    taken = [p for p in params if p not in _UNUSED_INPUTS]
    first = ('labels', 'loss_mask', 'output_layer', 'output_weight', 'is_training', 'config')
    unused = [p for p in params if p in _UNUSED_INPUTS[:2]]
    return [
        '',
        '',
        'def mtp_loss_inputs(',
        *signature,
        ') -> MTPLossInputs:',
        '    """The arguments of ``process_mtp_loss`` but ``hidden_states`` as the mtp_tv MTP losses',
        "    take them, with this module's ``roll_tensor`` and MTP tracker.",
        *(['',
           f'    {" and ".join(f"``{u}``" for u in unused)} are unused: the losses build no full',
           '    logits.'] if unused else []),
        '    """',
        '',
        '    def roll(tensor, field, depth):  # one position left, as process_mtp_loss rolls',
        *_roll_body(facts),
        '',
        '    def record_depth_metrics(loss, correct, count, layer_number, num_layers, avg_group):',
        *_record_body(facts),
        '',
        '    return MTPLossInputs(',
        *_keyword_lines(first, ' ' * 8),
        '        roll=roll,',
        '        record_depth_metrics=record_depth_metrics,',
        '        tracker=MTPLossLoggingHelper.tracker,',
        *_keyword_lines([p for p in taken if p not in first], ' ' * 8),
        *(['        detach_output_weight=config.mtp_detach_heads,'] if facts.mtp_detach_heads else []),
        '    )',
    ]


def snippet_track_metrics() -> List[str]:
    return [
        "        # mtp_tv: the acceptance metrics of every mtp_loss_type ('ce': with mtp_log_acceptance).",
        '        log_acceptance_metrics(',
        '            MTPLossLoggingHelper.tracker, iteration, writer, wandb_writer, total_loss_dict',
        '        )',
        '',
    ]


def snippet_gpt_import(inline: bool) -> List[str]:
    names = GPT_IMPORTS + (INLINE_IMPORTS if inline else ())
    return [
        f'from {MTP_MODULE} import {", ".join(GPT_MTP_IMPORTS)}',
        *([f'from {TARGET_MODULE}.config import {", ".join(INLINE_CONFIG_IMPORTS)}']
          if inline else []),
        f'from {MTP_LOSS_MODULE} import (',
        *[f'    {name},' for name in sorted(names)],
        ')',
    ]


def snippet_postprocess_start() -> List[str]:
    """First in ``GPTModel._postprocess``: no drafts split off yet."""
    return [
        f'        {DRAFTS_VAR} = None  # mtp_tv: the MTP depths\' states, for the loss on the main logits',
    ]


def _follows(output_processor: bool) -> str:
    args = 'self, output_processor' if output_processor else 'self'
    return f'mtp_loss_follows_main_logits({args})'


def _split(indent: str, main: str = 'hidden_states') -> List[str]:
    return [f'{indent}{main}, {DRAFTS_VAR} = split_mtp_hidden_states(',
            f'{indent}    hidden_states, self.config',
            f'{indent})']


def snippet_process_mtp_loss_call(call: Sequence[Tuple[str, str]]) -> List[str]:
    """``_postprocess``'s ``hidden_states = process_mtp_loss(...)`` statement, as the tree has
    it (the lines the wrapped call replaces)."""
    return ([f'{CALL_INDENT}hidden_states = process_mtp_loss(']
            + [f'{CALL_KWARG_INDENT}{k}={v},' for k, v in call] + [f'{CALL_INDENT})'])


def snippet_wrapped_call(call: Sequence[Tuple[str, str]], output_processor: bool
                         ) -> List[Tuple[int, int, List[str]]]:
    """The edits of that statement, ``(start, stop, new lines)`` relative to its first line: its
    arguments held once (``KWARGS_VAR``; its first line becomes ``KWARGS_VAR = dict(`` and its
    ``hidden_states`` argument goes), then ``process_mtp_loss`` after it, or only the split of
    the hidden states where the MTP loss runs on the main logits below."""
    hidden = 1 + [k for k, _ in call].index('hidden_states')
    end = len(call) + 2
    return [
        (0, 1, [f'{CALL_INDENT}# mtp_tv: the MTP loss arguments, for process_mtp_loss or for the main logits',
                f'{CALL_INDENT}{KWARGS_VAR} = dict(']),
        (hidden, hidden + 1, []),
        (end, end, [
            f'{CALL_INDENT}if {_follows(output_processor)}:',
            *_split(CALL_INDENT + '    '),
            f'{CALL_INDENT}else:',
            f'{CALL_INDENT}    hidden_states = process_mtp_loss(hidden_states=hidden_states, **{KWARGS_VAR})',
        ]),
    ]


def snippet_attach(indent: int) -> List[str]:
    """After each ``logits, _ = self.output_layer(...)`` of ``_postprocess``: the MTP loss on
    those logits (its target), attached to them, with the arguments held in ``KWARGS_VAR``."""
    pad = ' ' * indent
    return [
        f'{pad}if {DRAFTS_VAR} is not None:  # mtp_tv: the MTP loss against these main logits',
        f'{pad}    mtp_tv_inputs = mtp_loss_inputs(**{KWARGS_VAR})',
        f'{pad}    logits = attach_mtp_tv_loss(',
        f'{pad}        logits, hidden_states, {DRAFTS_VAR}, mtp_tv_inputs, MTPLossAutoScaler',
        f'{pad}    )',
    ]


def snippet_inline_gpt(output_processor: bool) -> Tuple[List[str], List[str]]:
    """(lines inserted before the inline branch, lines replacing its ``if`` line)."""
    before = [
        "        # mtp_tv: every MTP loss but Megatron's own 'ce' goes to process_mtp_tv_loss, fed what the",
        "        # 'ce' branch below uses: the tokens in mtp_kwargs['mtp_labels'] rolled once into labels",
        "        # with the loss mask, and a detached output layer (the MTP loss does not train it).",
        f'        {HIDDEN_VAR} = None',
        "        if self.config.mtp_num_layers and mtp_kwargs.get('mtp_labels', None) is not None:",
        f'            {KWARGS_VAR} = dict(',
        '                labels=None,',
        "                input_ids=mtp_kwargs['mtp_labels'],",
        '                loss_mask=loss_mask,',
        '                output_layer=self.output_layer,',
        '                output_weight=(',
        '                    output_weight if output_weight is not None else self.output_layer.weight',
        '                ).detach(),',
        '                runtime_gather_output=runtime_gather_output,',
        '                is_training=self.training,',
        '                compute_language_model_loss=self.compute_language_model_loss,',
        '                config=self.config,',
        '                cp_group=self.cp_group,',
        '                packed_seq_params=packed_seq_params,',
        '            )',
        '            megatron_ce = runs_megatron_ce(self.config)',
        f'            if {_follows(output_processor)}:  # the loss on the main logits below',
        *_split('                ', main=HIDDEN_VAR),
        '            elif not megatron_ce or (self.training and self.config.mtp_log_acceptance):',
        '                main_hidden_states, mtp_tv_loss = process_mtp_tv_loss(',
        f'                    hidden_states, mtp_loss_inputs(**{KWARGS_VAR})',
        '                )',
        "                if not megatron_ce:  # else Megatron's own 'ce', in the branch below",
        f'                    {HIDDEN_VAR} = main_hidden_states',
        '                    if mtp_tv_loss is not None:',
        f'                        {HIDDEN_VAR} = MTPLossAutoScaler.apply(',
        '                            main_hidden_states, mtp_tv_loss',
        '                        )',
    ]
    replace = [
        f'        if {HIDDEN_VAR} is not None:',
        f'            hidden_states = {HIDDEN_VAR}',
        f'        elif {INLINE_CONDITION}:',
    ]
    return before, replace


def expected_edits(facts: Facts) -> Dict[str, List[Tuple[List[str], List[str]]]]:
    """``{file: [(added lines, removed lines) per edit, in file order]}`` for a tree with ``facts``.

    File order holds in every supported tree: the import, the fields and ``__post_init__`` in
    transformer_config.py; the imports, ``track_mtp_metrics``, ``process_mtp_loss`` (its body) and
    ``mtp_loss_inputs`` (at the end) in multi_token_prediction.py; in gpt_model.py the imports,
    then inside ``GPTModel._postprocess`` its first line, the ``process_mtp_loss`` call (or the
    inline branch) and the main head's projections.
    """
    mtp = [(snippet_mtp_imports(), []), (snippet_track_metrics(), [])]
    if facts.process_mtp_loss_params is not None:
        mtp.append((snippet_process_mtp_loss(facts.process_mtp_loss_params), []))
    mtp.append((snippet_mtp_loss_inputs(facts), []))
    gpt = [(snippet_gpt_import(facts.inline_gpt_loss), []), (snippet_postprocess_start(), [])]
    if facts.inline_gpt_loss:
        before, replace = snippet_inline_gpt(facts.postprocess_output_processor)
        gpt += [(before, []), (replace, [f'        if {INLINE_CONDITION}:'])]
    else:
        call = facts.process_mtp_loss_call
        statement = snippet_process_mtp_loss_call(call)
        gpt += [(new, statement[start:stop])
                for start, stop, new in snippet_wrapped_call(call, facts.postprocess_output_processor)]
    gpt += [(snippet_attach(indent), []) for indent in facts.main_logits_projections]
    return {
        CONFIG_FILE: [(snippet_config_import(), []), (snippet_fields(), []), (snippet_validate(), [])],
        MTP_FILE: mtp,
        GPT_FILE: gpt,
        TRAINING_FILE: snippet_flops_edits(facts.flops_tokens) + [(snippet_get_model(), [])],
    }


def expected_changes(facts: Facts) -> Dict[str, Tuple[List[str], List[str]]]:
    """``{file: (added lines, removed lines)}``, the edits of :func:`expected_edits` concatenated."""
    return {
        path: ([l for a, _ in edits for l in a], [l for _, r in edits for l in r])
        for path, edits in expected_edits(facts).items()
    }
