"""Reference objectives for whole-model tests, from the MTP block's captured hidden states.

The model under test runs with the package's loss. The reference run uses the same weights but
swaps the model's ``process_mtp_loss`` for a stub that only records the hidden states (still in
the autograd graph), then adds the MTP objective computed by ``mtp_tv_dev.reference`` from the
equations, and differentiates that with plain autograd.
"""

import contextlib

import torch

from mtp_tv_dev.reference import depth_terms, objective, per_token_values, shifted_mask


@contextlib.contextmanager
def recorded_mtp_hidden(monkeypatch_target_modules=('megatron.core.models.gpt.gpt_model',)):
    """Replace ``process_mtp_loss`` by a recorder; yields a dict with ``hidden`` [(1+D)s, b, h].

    The model computes its MTP loss in ``process_mtp_loss`` meanwhile (``own_projection``), not
    after the main logits, so that the recorder sees the hidden states."""
    import importlib

    from mtp_tv_dev.models import own_projection

    record = {}
    saved = []

    def recorder(hidden_states, config, **kwargs):
        record['hidden'] = hidden_states
        return torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)[0]

    for name in monkeypatch_target_modules:
        module = importlib.import_module(name)
        saved.append((module, module.process_mtp_loss))
        module.process_mtp_loss = recorder
    try:
        with own_projection():
            yield record
    finally:
        for module, fn in saved:
            module.process_mtp_loss = fn


def mtp_reference_objective(
    hidden, depth, weight, loss_mask, loss_type, scale, seq_bounds=None, per_token_scale=1.0,
    temperature=1.0, eta=3.0,
):
    """The MTP part of the objective from recorded hidden states ``[(1+D)s, b, h]``.

    ``loss_mask`` is the ``[b, s]`` mask of the main loss (labels shifted once); depth k's mask is
    it shifted by k+1 within each sequence.

    Returns ``(objective, alpha [D, s, b], masks [D, s, b], logged [D])``, ``logged`` being the
    masked mean per-token objective of each depth that ``mtp_{k} loss`` reports.
    """
    chunks = torch.chunk(hidden, 1 + depth, dim=0)
    main, depths = chunks[0], list(chunks[1:])
    alpha, kl = depth_terms(main.detach(), depths, weight, seq_bounds=seq_bounds, temperature=temperature)
    masks = torch.stack(
        [shifted_mask(loss_mask, k + 1, seq_bounds).t() for k in range(depth)]
    ).double()
    value = objective(loss_type, alpha, kl, masks, scale, eta) * per_token_scale
    per_token = per_token_values(loss_type, alpha, kl, eta).detach()
    logged = (masks * per_token).sum((1, 2)) / masks.sum((1, 2)).clamp(min=1)
    return value, alpha, masks, logged.float()
