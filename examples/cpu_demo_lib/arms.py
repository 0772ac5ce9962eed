"""The demo's arms: which heads an arm trains (scenario) and with which MTP loss.

* ``'<loss>'``: heal the grafted (warm) heads at temperature 1;
* ``'serve_<loss>'``: the same with ``mtp_tv_temperature`` = the serving temperature (not 'ce',
  whose loss does not depend on the temperature);
* ``'cold_<loss>'``: train re-initialised heads at temperature 1.

No torch here: the command line is checked before anything heavy is imported.
"""

from typing import Tuple

#: The MTP losses an arm can train with (``mtp_loss_type``).
LOSSES = ('ce', 'kl', 'tv', 'lk', 'nla', 'e2e_tv')
ARMS = LOSSES + tuple(f'serve_{x}' for x in LOSSES if x != 'ce') + tuple(
    f'cold_{x}' for x in LOSSES)
DEFAULT_ARMS = ('ce', 'tv', 'e2e_tv', 'serve_tv', 'cold_ce', 'cold_kl', 'cold_tv', 'cold_lk',
                'cold_nla', 'cold_e2e_tv')


def arm_kind(arm: str) -> Tuple[str, str]:
    """``(scenario, loss)``: scenario 'warm', 'serve' or 'cold'."""
    for prefix in ('serve', 'cold'):
        if arm.startswith(prefix + '_'):
            return prefix, arm[len(prefix) + 1:]
    return 'warm', arm
