"""Drive Megatron's own argument parsing in-process, as pretrain_gpt.py and miles do.

:func:`config_from_argv` runs ``parse_args(extra_args_provider=...)``, ``validate_args`` and
``core_transformer_config_from_args`` on a command line and returns ``(args, config)``. Two
stand-ins for the GPU node the flags are meant for, both outside the MTP code paths:
``validate_args`` asks the GPU for its architecture (answered: 9, Hopper), and building the config
checks that Transformer Engine provides RoPE fusion (``apply_rope_fusion`` is turned off before
the config is built, since this machine has no TE).
"""

import sys
from typing import Callable, List, Optional, Sequence


def reset_arg(parser, name, **kwargs):
    """miles' helper (miles/utils/arguments.py): give an existing Megatron flag a new default,
    or add the flag if Megatron does not have it."""
    for action in parser._actions:
        if name in action.option_strings:
            if 'default' in kwargs:
                action.default = kwargs['default']
            break
    else:
        parser.add_argument(name, **kwargs)


def miles_extra_args_provider(parser):
    """What miles' ``add_mtp_training_arguments`` does to Megatron's parser."""
    reset_arg(parser, '--mtp-num-layers', type=int, default=None)
    reset_arg(parser, '--mtp-loss-scaling-factor', type=float, default=0.2)
    parser.add_argument('--enable-mtp-training', action='store_true', default=False,
                        help='Enable MTP layer parameter updates during training')
    return parser


def parse(argv: Sequence[str], provider: Optional[Callable] = None, monkeypatch=None,
          world_size: int = 1):
    """Megatron's ``parse_args`` on ``argv`` (unknown flags are errors)."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', ['pretrain_gpt.py', *argv])
    monkeypatch.setenv('WORLD_SIZE', str(world_size))
    monkeypatch.setenv('RANK', '0')
    return parse_args(extra_args_provider=provider)


def validated_args(argv: List[str], monkeypatch, provider=None, world_size: int = 1):
    """``parse_args`` then ``validate_args`` on ``argv``, as Megatron's and miles' start-up do."""
    import megatron.training.arguments as arguments

    args = parse(argv, provider, monkeypatch, world_size)
    monkeypatch.setattr(arguments, 'get_device_arch_version', lambda: 9)
    monkeypatch.setenv('CUDA_DEVICE_MAX_CONNECTIONS', '1')
    arguments.validate_args(args)
    args.apply_rope_fusion = False
    return args


def config_from_argv(argv: List[str], monkeypatch, provider=None, world_size: int = 1):
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = validated_args(argv, monkeypatch, provider, world_size)
    return args, core_transformer_config_from_args(args)
