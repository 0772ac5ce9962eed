"""NVIDIA/Megatron-LM PR #6473's end-to-end TV, composed as its ``_process_mtp_e2e_tv_loss``
composes it, on the inputs this project's ``'e2e_tv'`` takes, and which of its paths ran.

The PR's two functions (``megatron/core/fusions/fused_mtp_tv.py`` and ``fused_mtp_prefix.py`` at
``tools/fetch_upstream_e2e_tv.py``'s commit, loaded by :func:`gpucheck.preflight.upstream_e2e_tv`):

* ``vocab_parallel_tv_distance(draft_logits, target_logits, tp_group, logits_are_vocab_sharded)``:
  ``1 - sum_v min(softmax(draft), softmax(target))`` per row, fp32, the target detached; its
  gradient reaches the draft logits only. It runs its Triton kernels where
  ``fused_mtp_tv_unavailable_reason(draft, target)`` is None (CUDA, bf16 or fp32, equal dtypes,
  contiguous), else its torch ``_VocabParallelTVDistance``;
* ``mtp_e2e_prefix_objective(acceptances [G, ...])``: ``(mean_k (1 - prod_{i<=k} alpha_i),
  the per-depth terms)``, Triton where ``fused_mtp_prefix_unavailable_reason(acceptances)`` is
  None (CUDA, fp32, contiguous), else ``torch.cumprod``.

How the two objectives line up. The PR's per-chain value ``mean_k (1 - prod_{i<=k} alpha_i)`` is
this project's ``1 - (1/G) sum_j prod_{i<=j} alpha_i`` (Bebop Eq. 13) term for term: the PR's mean
over depths is the project's ``1/G``. Both then weight a chain by ``scale * chain_valid /
n_chains`` and sum (the PR's ``normalized_loss``, summed by ``MTPLossAutoScaler``'s backward; the
project's per-chain ``token_weights``); neither divides the scale by G, as Megatron's per-depth CE
does. Depth k's target is the main logits at ``t + k + 1``: the PR rolls them by one per depth
(the vacated rows zero, a uniform target, which the chain mask removes); the project reads row
``t + k + 1``. The one place they may differ is a tie ``p == q``: the project's minimum takes p
(its gradient skips the token), the PR's takes q; with continuous logits a tie has probability 0.
"""

from typing import Dict, Optional, Tuple

import torch


def e2e_tv_loss(drafts: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                chain_weights: torch.Tensor, upstream: Dict,
                tp_group=None) -> Tuple[torch.Tensor, Dict[str, str]]:
    """``(loss, path)``: the PR's e2e-TV of ``drafts`` ``[G, s, b, h]`` against the main logits
    ``target_logits`` ``[s, b, V]`` (detached), each chain weighted by ``chain_weights``
    ``[s, b]``; ``path`` says which of its implementations ran (:func:`path_of`)."""
    target = target_logits.detach()
    distances, reasons = [], []
    for k in range(drafts.shape[0]):
        # roll_tensor(shifts=-1) along the sequence, the vacated row zero-filled. Its caller
        # hands a permuted (non-contiguous) view that vocab_parallel_tv_distance packs before
        # its dispatch; torch.cat is that packed tensor, so the dispatch sees the same input.
        target = torch.cat([target[1:], torch.zeros_like(target[:1])])
        draft = torch.matmul(drafts[k], weight.t())  # the output layer's logits, in its dtype
        reasons.append(_reason(upstream, 'tv_unavailable_reason', draft, target))
        distances.append(upstream['tv_distance'](draft, target, tp_group=tp_group,
                                                 logits_are_vocab_sharded=True))
    acceptances = 1.0 - torch.stack(distances)
    prefix_reason = _reason(upstream, 'prefix_unavailable_reason', acceptances)
    per_chain, _ = upstream['prefix_objective'](acceptances)
    loss = (per_chain * chain_weights).sum()
    return loss, {'pr6473_tv': path_of(reasons[0]), 'pr6473_prefix': path_of(prefix_reason)}


_MISSING = object()


def _reason(upstream: Dict, name: str, *tensors):
    """The PR's own answer to "why not the fused kernel" (None: it runs), or :data:`_MISSING`
    where the loaded module has no such function (another revision of the PR)."""
    function = upstream.get(name)
    return _MISSING if function is None else function(*tensors)


def path_of(reason: Optional[str]) -> str:
    """``'triton (fused)'`` where the PR's dispatch takes its kernel, else its fallback and why."""
    if reason is _MISSING:
        return 'unknown (the module has no *_unavailable_reason function)'
    return 'triton (fused)' if reason is None else f'torch fallback: {reason}'
