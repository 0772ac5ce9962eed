"""The lines a patch inserts into Megatron files (functions of the package source and of a
target's :class:`~patchgen.facts.Facts` only), and the edits each touched file gets.
"""

from typing import Dict, List, Sequence, Tuple

from .facts import Facts
from .layout import (
    CONFIG_FILE, GPT_FILE, INLINE_CONDITION, MTP_FILE, TARGET_MODULE, TRAINING_FILE, TRAINING_MODULE,
)

from .package import fields_block, tv_loss_params

#: Where ``GPTModel._postprocess`` takes the MTP loss on its main logits from
#: (megatron/mtp_tv/mtp_loss.py), and what it imports.
MTP_LOSS_MODULE = f'{TARGET_MODULE}.mtp_loss'
GPT_IMPORTS = ('attach_mtp_tv_loss', 'mtp_loss_follows_main_logits', 'split_mtp_hidden_states')
#: The local of the patched ``_postprocess`` that holds the drafts' hidden states, split off
#: for the MTP loss on the main logits (None otherwise).
DRAFTS_VAR = 'mtp_tv_drafts'
#: The local that holds the MTP loss's keyword arguments (``process_mtp_loss``'s but the hidden
#: states), for both places the loss can run.
KWARGS_VAR = 'mtp_tv_kwargs'
#: The local that holds what ``process_mtp_tv_loss`` returns: None where Megatron's own code
#: computes the loss (``'ce'``).
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


def snippet_process_mtp_loss(params: Sequence[str]) -> List[str]:
    tv = tv_loss_params()
    kwargs = [f'        {p}={p},' for p in params if p in tv]
    return [
        "    # mtp_tv: every MTP loss but Megatron's own 'ce', which the code after this block computes",
        '    # (None here). Imported here: mtp_tv imports this module.',
        f'    from {TARGET_MODULE}.mtp_loss import process_mtp_tv_loss',
        '',
        f'    {HIDDEN_VAR} = process_mtp_tv_loss(',
        *kwargs,
        '    )',
        f'    if {HIDDEN_VAR} is not None:',
        f'        return {HIDDEN_VAR}',
        '',
    ]


def snippet_track_metrics() -> List[str]:
    return [
        "        # mtp_tv: the acceptance metrics of every mtp_loss_type ('ce': with mtp_log_acceptance).",
        f'        from {TARGET_MODULE}.metrics import log_acceptance_metrics',
        '',
        '        log_acceptance_metrics(iteration, writer, wandb_writer, total_loss_dict)',
        '',
    ]


def snippet_gpt_import() -> List[str]:
    return [f'from {MTP_LOSS_MODULE} import (', *[f'    {name},' for name in GPT_IMPORTS], ')']


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
        f'{pad}    logits = attach_mtp_tv_loss(logits, hidden_states, {DRAFTS_VAR}, **{KWARGS_VAR})',
    ]


def snippet_inline_gpt(output_processor: bool) -> Tuple[List[str], List[str]]:
    """(lines inserted before the inline branch, lines replacing its ``if`` line)."""
    before = [
        "        # mtp_tv: every MTP loss but Megatron's own 'ce' goes to process_mtp_tv_loss, fed what the",
        "        # 'ce' branch below uses: the tokens in mtp_kwargs['mtp_labels'] rolled once into labels",
        "        # with the loss mask, and a detached output layer (the MTP loss does not train it).",
        f'        {HIDDEN_VAR} = None',
        "        if self.config.mtp_num_layers and mtp_kwargs.get('mtp_labels', None) is not None:",
        '            # Imported here: the mtp_tv package imports multi_token_prediction.',
        f'            from {TARGET_MODULE}.mtp_loss import process_mtp_tv_loss',
        '',
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
        f'            if {_follows(output_processor)}:  # the loss on the main logits below',
        *_split('                ', main=HIDDEN_VAR),
        '            else:',
        f'                {HIDDEN_VAR} = process_mtp_tv_loss(hidden_states, **{KWARGS_VAR})',
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
    transformer_config.py; ``track_mtp_metrics``, ``process_mtp_loss`` (its last parameter, then
    its body) and ``MultiTokenPredictionBlock.__init__`` in multi_token_prediction.py; in
    gpt_model.py the import, then inside ``GPTModel._postprocess`` its first line, the
    ``process_mtp_loss`` call (or the inline branch) and the main head's projections.
    """
    mtp = [(snippet_track_metrics(), [])]
    if facts.process_mtp_loss_params is not None:
        mtp.append((snippet_process_mtp_loss(facts.process_mtp_loss_params), []))
    gpt = [(snippet_gpt_import(), []), (snippet_postprocess_start(), [])]
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
