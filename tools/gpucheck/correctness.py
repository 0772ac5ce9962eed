"""The GPU check's correctness phases: each returns a list of rows ``{'check', ..., 'ok'}``.

Every comparison is against an independent reference: the float64 full-vocabulary formulas of
``mtp_tv_dev/reference.py`` (on the CPU), the torch row ops for the Triton kernels, Megatron's
own cross-entropy for the chunked one, the loss's own other target source or chunking, and the
same run repeated (determinism). Every row says which path ran (``path``: the row ops, the
products, Megatron's CE, PR #6473's kernels; ``gpucheck/paths.py``).
"""

import contextlib
from typing import Dict, List

import torch

from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES, CrossEntropy
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.row_ops import TorchRowOps, TritonRowOps
from mtp_tv_dev.models import forced_grad_storage
from mtp_tv_dev.reference import depth_terms, e2e_objective, objective, token_weights

from gpucheck import paths, pr6473


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def against_reference(device: str, kernels: str, quick: bool) -> List[Dict]:
    """fp32 loss and gradients of every loss on ``device`` vs the float64 CPU reference; 1 and
    3 depths, several chunk sizes, either storage for backward (the gradients, or the logit
    gradients)."""
    S, B, H, V = (9, 2, 16, 300) if quick else (37, 2, 32, 5003)
    rows, path = [], paths.package(device, kernels, torch.float32)
    for loss_type in LOSSES:
        temperature = 0.7 if loss_type == 'lk' else 1.0
        for G in (1, 3):
            g = torch.Generator().manual_seed(G)
            draft = torch.randn(G, S, B, H, generator=g, dtype=torch.float64)
            target = torch.randn(S, B, H, generator=g, dtype=torch.float64)
            weight = torch.randn(V, H, generator=g, dtype=torch.float64)
            masks = (torch.rand(G, S, B, generator=g) > 0.3).double()
            for k in range(G):
                masks[k, S - k - 1:] = 0
            d_ref, w_ref = draft.clone().requires_grad_(), weight.clone().requires_grad_()
            alpha, kl = depth_terms(target, list(d_ref), w_ref, temperature=temperature)
            ref = objective(loss_type, alpha, kl, masks, 0.3)
            ref.backward()
            for chunk in (0, 7, 64):
                for storage in ('dense', 'logit_grads'):
                    d = draft.float().to(device).requires_grad_()
                    w = weight.float().to(device).requires_grad_()
                    with forced_grad_storage(storage):
                        options = MTPLossOptions(loss_type, chunk_size=chunk,
                                                 temperature=temperature, kernels=kernels)
                        out = linear_tv_loss(d, target.float().to(device), w,
                                             token_weights(loss_type, masks).float().to(device),
                                             options)
                    out.loss.backward()
                    errs = {'loss': abs(out.loss.item() - ref.item()),
                            'grad_draft': _max_err(d.grad, d_ref.grad),
                            'grad_weight': _max_err(w.grad, w_ref.grad)}
                    ok = (errs['loss'] <= 1e-5 + 1e-4 * abs(ref.item())
                          and errs['grad_draft'] <= 1e-6 + 1e-3 * d_ref.grad.abs().max().item()
                          and errs['grad_weight'] <= 1e-6 + 1e-3 * w_ref.grad.abs().max().item())
                    rows.append({'check': 'reference', 'loss_type': loss_type, 'G': G,
                                 'chunk': chunk, 'storage': storage, **errs, 'path': path,
                                 'ok': ok})
    return rows


def kernels_against_torch(device: str, vocabs: List[int], rows_per_chunk: int) -> List[Dict]:
    """Triton row kernels vs the torch row ops on the same logits, at each vocabulary (several
    tiles and a masked tail), row offsets 0 and 2."""
    out = []
    names = ('row_max', 'argmax', 'overlap', 'dot', 'kl', 'grad')
    for V in vocabs:
        n = rows_per_chunk
        g = torch.Generator().manual_seed(V)
        zt = (torch.randn(n + 2, V, generator=g) * 3).to(device)
        zq = (torch.randn(n, V, generator=g) * 3).to(device)
        coef = torch.rand(n, generator=g).to(device)
        kl_coef = torch.rand(n, generator=g).to(device)

        def passes(ops, offset):
            t, _ = ops.normalise_(zt.clone(), None, vocab_start=0)
            q, q_stats = ops.normalise_(zq.clone(), None, vocab_start=0)
            p = ops.rows(t, offset, offset + n)
            overlap, dot, kl = ops.pair_sums(p, q, dot=True, kl=True)
            grad = ops.grad_(p, q, dot, coef, kl_coef)  # the LK form: both terms
            grad = (grad[0] if isinstance(grad, tuple) else grad).clone()
            return q_stats.max, q_stats.argmax.float(), overlap, dot, kl, grad

        for offset in (0, 2):
            ref = passes(TorchRowOps(), offset)
            got = passes(TritonRowOps(), offset)
            errs = {name: _max_err(a, b) for name, a, b in zip(names, got, ref)}
            ok = (errs['row_max'] == 0.0 and errs['argmax'] == 0.0 and errs['overlap'] <= 1e-5
                  and errs['dot'] <= 1e-5 and errs['kl'] <= 1e-4
                  and errs['grad'] <= 1e-4 * ref[-1].abs().max().item() + 1e-9)
            out.append({'check': 'kernels', 'n': n, 'V': V, 'offset': offset, **errs,
                        'path': {'row_ops': 'triton against torch'}, 'ok': ok})
    return out


def bf16_against_fp32(device: str, kernels: str, quick: bool) -> List[Dict]:
    """A bf16 model (hidden states and weight) against its fp32 twin: close loss, finite grads."""
    S, B, H, V = (16, 2, 32, 512) if quick else (256, 2, 512, 32768)
    g = torch.Generator().manual_seed(3)
    draft = torch.randn(2, S, B, H, generator=g)
    target = torch.randn(S, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) * H ** -0.5
    w = torch.full((S, B), 1.0 / (S * B))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        d = draft.to(device, dtype, copy=True).requires_grad_()
        wt = weight.to(device, dtype, copy=True).requires_grad_()
        res = linear_tv_loss(d, target.to(device, dtype), wt, w.to(device),
                             MTPLossOptions('e2e_tv', chunk_size=64, kernels=kernels))
        res.loss.backward()
        out[dtype] = (res.loss.item(), bool(torch.isfinite(d.grad).all()),
                      bool(torch.isfinite(wt.grad).all()))
    diff = abs(out[torch.float32][0] - out[torch.bfloat16][0])
    return [{'check': 'bf16 vs fp32', 'loss_fp32': out[torch.float32][0],
             'loss_bf16': out[torch.bfloat16][0], 'abs_diff': diff,
             'path': paths.package(device, kernels, torch.float32, torch.bfloat16),
             'ok': diff <= 2e-2 and all(out[torch.bfloat16][1:])}]


def chunked_ce_against_megatron(device: str, kernels: str, megatron_ce, quick: bool,
                                tp_group=None) -> List[Dict]:
    """``'ce'`` through the chunked sweep against Megatron's ``vocab_parallel_cross_entropy`` on
    the same fp32 inputs: loss and both gradients."""
    S, B, H, V = (12, 2, 16, 300) if quick else (1024, 2, 256, 32768)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, S, B, H, generator=g).to(device)
    weight = (torch.randn(V, H, generator=g) * 0.1).to(device)
    labels = torch.randint(0, V, (1, S, B), generator=g).to(device)
    w = torch.full((1, S, B), 1.0 / (S * B), device=device)
    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = (megatron_ce(torch.matmul(x1[0], w1.t()), labels[0], tp_group=tp_group) * w[0]).sum()
    ref.backward()
    rows, path = [], {**paths.package(device, kernels, torch.float32), **paths.megatron_ce()}
    for chunk in (0, 100):
        x2, w2 = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = linear_tv_loss(x2, None, w2, w,
                             MTPLossOptions(CrossEntropy(), chunk_size=chunk, kernels=kernels),
                             labels=labels)
        out.loss.backward()
        errs = {'loss': abs(out.loss.item() - ref.item()), 'grad_x': _max_err(x2.grad, x1.grad),
                'grad_weight': _max_err(w2.grad, w1.grad)}
        ok = (errs['loss'] <= 1e-5 * max(1.0, abs(ref.item()))
              and errs['grad_x'] <= 1e-6 + 1e-4 * x1.grad.abs().max().item()
              and errs['grad_weight'] <= 1e-6 + 1e-4 * w1.grad.abs().max().item())
        rows.append({'check': 'chunked ce vs megatron ce', 'chunk': chunk, **errs, 'path': path,
                     'ok': ok})
    return rows


def main_logits_against_projection(device: str, kernels: str, dtype: torch.dtype,
                                   quick: bool) -> List[Dict]:
    """The production default (the target read from the main logits the model projects anyway)
    against the loss's own projection of the target: the same loss and gradients, every loss."""
    S, B, H, V = (10, 2, 16, 300) if quick else (512, 2, 512, 32768)
    rows, path = [], paths.package(device, kernels, dtype)
    for loss_type in LOSSES:
        g = torch.Generator().manual_seed(5)
        draft = torch.randn(2, S, B, H, generator=g).to(device, dtype)
        target = torch.randn(S, B, H, generator=g).to(device, dtype)
        weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, dtype)
        masks = (torch.rand(2, S, B, generator=g) > 0.2).float()
        w = token_weights(loss_type, masks).to(device)
        results = {}
        for source in ('projection', 'main_logits'):
            d, wt = draft.clone().requires_grad_(), weight.clone().requires_grad_()
            kwargs = ({'target_logits': torch.matmul(target, wt.detach().t())}
                      if source == 'main_logits' else {})
            out = linear_tv_loss(d, target if source == 'projection' else None, wt, w,
                                 MTPLossOptions(loss_type, chunk_size=64, kernels=kernels),
                                 **kwargs)
            out.loss.backward()
            results[source] = (out.loss.detach(), d.grad, wt.grad)
        (l1, d1, w1), (l2, d2, w2) = results['projection'], results['main_logits']
        # bf16 main logits round the target: its tolerance is bf16's, not fp32's
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        errs = {'loss': _max_err(l1, l2), 'grad_draft': _max_err(d1, d2),
                'grad_weight': _max_err(w1, w2)}
        ok = (errs['loss'] <= tol * max(1.0, abs(l1.item()))
              and errs['grad_draft'] <= tol * d1.abs().max().item() + 1e-7
              and errs['grad_weight'] <= tol * w1.abs().max().item() + 1e-7)
        rows.append({'check': 'main logits vs projection', 'loss_type': loss_type,
                     'dtype': str(dtype), **errs, 'path': path, 'ok': ok})
    return rows


def big_chunk(device: str, kernels: str, dtype: torch.dtype, tokens: int, hidden: int,
              vocab: int) -> List[Dict]:
    """One chunk of ``tokens x vocab`` logits (above 2^31 at 16384 x 151936: int64 offsets in
    every kernel) against the same loss in chunks of 2048: loss and gradients agree, finite."""
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(1, tokens, 1, hidden, generator=g)).to(device, dtype)
    y = (torch.randn(tokens, 1, hidden, generator=g)).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    w = torch.full((1, tokens, 1), 1.0 / tokens, device=device)
    results = {}
    for chunk in (tokens, 2048):
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = linear_tv_loss(xg, y, wg, w, MTPLossOptions('tv', chunk_size=chunk, kernels=kernels))
        out.loss.backward()
        results[chunk] = (out.loss.detach().float(), xg.grad.float(), wg.grad.float())
        del out, xg, wg
        if device.startswith('cuda'):
            torch.cuda.empty_cache()
    (l1, x1, w1), (l2, x2, w2) = results[tokens], results[2048]
    errs = {'loss': _max_err(l1, l2), 'grad_x': _max_err(x1, x2), 'grad_weight': _max_err(w1, w2)}
    finite = all(bool(torch.isfinite(t).all()) for t in (l1, x1, w1))
    ok = (finite and errs['loss'] <= 1e-3 * max(1.0, abs(l2.item()))
          and errs['grad_x'] <= 2e-2 * x2.abs().max().item() + 1e-7
          and errs['grad_weight'] <= 2e-2 * w2.abs().max().item() + 1e-7)
    return [{'check': 'one chunk above 2^31 logits' if tokens * vocab > 2**31 else 'big chunk',
             'tokens': tokens, 'vocab': vocab, 'logits': tokens * vocab, 'dtype': str(dtype),
             **errs, 'finite': finite, 'path': paths.package(device, kernels, dtype), 'ok': ok}]


@contextlib.contextmanager
def _model_world(device: str):
    """Megatron's parallel state for one process: on CUDA an NCCL world of one and Megatron's
    CUDA RNG tracker; on a CPU (the dry run) the CPU shims of ``mtp_tv_dev``."""
    if not device.startswith('cuda'):
        from mtp_tv_dev.distributed import single_process

        with single_process(seed=1234):
            yield
        return
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def model_steps(device: str, kernels: str, quick: bool, steps: int = 3) -> List[Dict]:
    """A megatron-core ``GPTModel`` with two MTP depths, bf16, trained ``steps`` Adam steps with
    ``'ce'`` and with ``'tv'`` (the target from the main logits, the default); twice each from the
    same seed: every loss finite and the two runs bit-identical."""
    from megatron.core.transformer.module import Float16Module

    from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss, random_batch

    vocab, hidden, seq, batch = (128, 32, 16, 2) if quick else (32768, 1024, 1024, 2)
    rows = []
    for loss_type in ('ce', 'tv'):
        runs = []
        for _ in range(2):
            with _model_world(device):
                torch.manual_seed(0)
                gpt = build_gpt_with_mtp(
                    vocab_size=vocab, hidden_size=hidden, num_layers=2, mtp_num_layers=2,
                    seq_length=seq, num_attention_heads=8, params_dtype=torch.bfloat16,
                    mtp_loss_type=loss_type, mtp_tv_kernels=kernels, seed=1234)
                # Megatron's own bf16 wrapper (what its training loop builds): bf16 weights
                # throughout, fp32 outputs
                model = Float16Module(gpt.config, gpt).to(device)
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
                tokens, labels, mask = (t.to(device) for t in random_batch(vocab, seq, batch))
                losses = []
                for _ in range(steps):
                    optimizer.zero_grad(set_to_none=True)
                    loss = forward_loss(model, tokens, labels, mask)
                    main = (loss.float() * mask).sum() / mask.sum()
                    main.backward()
                    optimizer.step()
                    losses.append(main.item())
                grads = torch.cat([p.grad.float().flatten() for p in model.parameters()
                                   if p.grad is not None])
                runs.append((losses, grads.cpu()))
                del model, optimizer
        (losses_a, grads_a), (losses_b, grads_b) = runs
        finite = all(torch.isfinite(torch.tensor(losses_a))) and bool(torch.isfinite(grads_a).all())
        same = losses_a == losses_b and torch.equal(grads_a, grads_b)
        # 'ce' is Megatron's own process_mtp_loss (GPTModel's default: no CE fusion)
        path = (paths.megatron_ce() if loss_type == 'ce'
                else paths.package(device, kernels, torch.bfloat16))
        rows.append({'check': 'GPTModel bf16 steps', 'loss_type': loss_type, 'steps': steps,
                     'main_losses': losses_a, 'finite': finite, 'deterministic': same,
                     'path': path, 'ok': finite and same})
    return rows


def fused_weight_gradient(device: str, kernels: str, quick: bool) -> List[Dict]:
    """Every loss in a ``GPTModel`` built with ``gradient_accumulation_fusion=True`` (apex's
    kernel where installed, else its torch stand-in) inside Megatron's DDP with the overlapped
    reduce and the distributed optimizer's buffers: every ``main_grad`` against plain autograd
    of the same fp32 model, the untied output weight (whose MTP share fusion once dropped)
    reported on its own."""
    from mtp_tv_dev.gpu_training import (
        apex_wgrad_fusion_installed,
        emulated_wgrad_fusion,
        gradients_after_step,
    )

    path = 'apex' if apex_wgrad_fusion_installed() else 'torch stand-in for apex'
    shape = dict(vocab=128, hidden=32, seq=16) if quick else dict(vocab=32768, hidden=1024, seq=512)
    configs = {'ce': dict(mtp_loss_type='ce'),
               'ce_chunked': dict(mtp_loss_type='ce', mtp_ce_chunked=True),
               **{name: dict(mtp_loss_type=name) for name in ('tv', 'e2e_tv', 'kl', 'lk', 'nla')}}
    rows = []
    for loss, fields in configs.items():
        fields = dict(fields, mtp_tv_kernels=kernels)
        with _model_world(device):
            expected = gradients_after_step(fields, False, False, fused=False, device=device,
                                            **shape)
            with emulated_wgrad_fusion():
                got = gradients_after_step(fields, False, False, fused=True,
                                           ddp_setting=(True, True), device=device, **shape)
        errs = {name: (got[name].float() - ref.float()).norm().item()
                / max(ref.float().norm().item(), 1e-12) for name, ref in expected.items()}
        worst = max(errs, key=errs.get)
        # the model is fp32 (gradients_after_step's default); 'ce' is Megatron's own loss
        loss_path = (paths.megatron_ce() if loss == 'ce'
                     else paths.package(device, kernels, torch.float32))
        rows.append({'check': 'fused weight gradient in DDP', 'loss_type': loss,
                     'fusion_path': path, 'path': {**loss_path, 'wgrad_fusion': path},
                     'output_weight_rel_err': errs['output_layer.weight'],
                     'worst_param': worst, 'worst_rel_err': errs[worst],
                     'ok': errs[worst] < 1e-4})
    return rows


def precision_against_float64(device: str, quick: bool) -> List[Dict]:
    """bf16 and fp16 (loss scale 2^16) gradients of every loss and target path against float64,
    beside Megatron's MTP cross-entropy's own error on the same rounded inputs
    (``tools/grad_precision.py``): each loss's error at most twice CE's, as the CPU suite holds."""
    import grad_precision

    losses = [*LOSSES, grad_precision.CHUNKED_CE]
    tokens, hidden, vocab = (64, 32, 512) if quick else (4096, 1024, 32768)
    rows = []
    for dtype_name in grad_precision.DTYPES:
        with _model_world(device):
            results = grad_precision.measure(dtype_name, tokens, losses, hidden, vocab,
                                             variants=grad_precision.VARIANTS, device=device)
        ce_draft, ce_weight = results['ce']
        # grad_precision's losses take the default kernels ('auto'); 'ce' is Megatron's
        ours = paths.package(device, 'auto', grad_precision.DTYPES[dtype_name])
        for name, (draft_err, weight_err) in results.items():
            ratio = max(draft_err / ce_draft, weight_err / ce_weight)
            rows.append({'check': 'gradient precision vs float64', 'dtype': dtype_name,
                         'loss': name, 'draft_rel_err': draft_err, 'weight_rel_err': weight_err,
                         'over_ce': ratio, 'path': paths.megatron_ce() if name == 'ce' else ours,
                         'ok': ratio <= 2.0})
    return rows


#: Tolerances on the max relative errors (:func:`_errors`), ``(loss, gradients)`` against float64
#: on the same rounded inputs, per dtype: this package's, then the PR's. In bf16 the PR's draft
#: logits leave the output layer rounded to bf16 (as in Megatron), and TV's gradient
#: ``1[q < p]`` flips wherever that rounding crosses p: its gradient error is that of bf16
#: logits (measured on CPU at hidden 256: 20-75% of the largest entry), this package's that of
#: fp32 logits of bf16 operands (0.5%). So in bf16 the PR's error is a measurement, not a
#: verdict on this package; fp32 rows hold both to fp32 accuracy (the objectives are the same).
E2E_TOLERANCES = {torch.float32: ((1e-4, 1e-3), (1e-4, 1e-3)),
                  torch.bfloat16: ((1e-3, 2e-2), (1e-2, 5e-2))}


def pr6473_against_e2e_tv(device: str, kernels: str, dtype: torch.dtype, upstream: Dict,
                          quick: bool, tp_group=None) -> List[Dict]:
    """NVIDIA PR #6473's e2e-TV (its fused kernels where they run, else its torch fallback,
    ``gpucheck/pr6473.py``) against this package's ``'e2e_tv'`` on the same inputs, and both
    against the float64 reference of the equations on the CPU: loss, and gradients w.r.t. the
    draft hidden states and the output weight (the PR's function takes the draft logits; their
    gradient reaches both through the output layer's product). fp32 and ``dtype``; 3 depths,
    masked chains; every vocabulary a multiple of the PR's 1024-wide tile and not (its masked
    tail and its bit-packed ``[V/8]`` row)."""
    S, B, H, vocabs = (9, 2, 16, [300]) if quick else (64, 2, 256, [151936, 5003])
    rows = []
    for V in vocabs:
        inputs = _e2e_inputs(3, S, B, H, V, seed=V)
        for dt in dict.fromkeys((torch.float32, dtype)):
            rows.append(_e2e_row(device, kernels, dt, inputs, upstream, tp_group))
    return rows


def _e2e_inputs(G: int, S: int, B: int, H: int, V: int, seed: int, scale: float = 0.3) -> Dict:
    """fp32 CPU inputs of a warm head (alpha about 0.4): depth k's draft is the main hidden
    state k + 1 positions ahead plus noise; logits of a trained LM's spread (about 3); chains
    masked at random and where a depth's target leaves the sequence."""
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(S, B, H, generator=g)
    drafts = torch.stack([torch.roll(main, -(k + 1), 0) + 0.6 * torch.randn(S, B, H, generator=g)
                          for k in range(G)])
    masks = (torch.rand(G, S, B, generator=g) > 0.1).float()
    for k in range(G):
        masks[k, S - k - 1:] = 0
    return {'drafts': drafts, 'main': main, 'weight': torch.randn(V, H, generator=g) * 3 / H**0.5,
            'masks': masks, 'scale': scale}


def _e2e_row(device: str, kernels: str, dtype: torch.dtype, inputs: Dict, upstream: Dict,
             tp_group) -> Dict:
    """One comparison row: ours, the PR's and float64's loss and gradients, their differences."""
    drafts = inputs['drafts'].to(device, dtype)
    weight = inputs['weight'].to(device, dtype)
    # The main head's logits in the model dtype: the one target all three read.
    target = torch.matmul(inputs['main'].to(device, dtype), weight.t())
    masks, scale = inputs['masks'], inputs['scale']
    chain_weights = token_weights('e2e_tv', masks, scale).to(device)

    d, w = drafts.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_tv_loss(d, None, w, chain_weights, MTPLossOptions('e2e_tv', kernels=kernels),
                          target_logits=target, tp_group=tp_group).loss
    loss.backward()
    ours = (loss, d.grad, w.grad)

    d, w = drafts.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, pr_path = pr6473.e2e_tv_loss(d, w, target, chain_weights, upstream, tp_group)
    loss.backward()
    theirs = (loss, d.grad, w.grad)

    d, w = (t.detach().cpu().double().requires_grad_() for t in (drafts, weight))
    alpha, _ = depth_terms(None, list(d), w, main_logits=target.cpu())
    loss = e2e_objective(alpha, masks.double(), scale)
    loss.backward()
    ref = (loss, d.grad, w.grad)

    errs = {'ours_vs_pr': _errors(ours, theirs), 'ours_vs_f64': _errors(ours, ref),
            'pr_vs_f64': _errors(theirs, ref)}
    verdict, ok = _e2e_verdict(errs, dtype)
    G, S, B, H = drafts.shape
    return {'check': 'PR #6473 vs e2e_tv', 'dtype': str(dtype), 'G': G, 'S': S, 'B': B,
            'V': weight.shape[0], 'loss_ours': ours[0].item(), 'loss_pr': theirs[0].item(),
            'loss_f64': ref[0].item(), 'alpha_mean': alpha.mean().item(), **errs,
            'verdict': verdict, 'path': {**paths.package(device, kernels, dtype), **pr_path},
            'ok': ok}


def _e2e_verdict(errs: Dict[str, Dict[str, float]], dtype: torch.dtype):
    """``(verdict, ok)``: ``'agree'`` where every pair is within its tolerance. Fails: this
    package off float64; in fp32 any pair off; the PR's loss off (continuous in the logits, its
    bf16 rounding moves it by 1e-4). Recorded only: the PR's bf16 gradients off float64."""
    (ours_loss, ours_grad), (pr_loss, pr_grad) = E2E_TOLERANCES.get(
        dtype, E2E_TOLERANCES[torch.bfloat16])
    # the two against each other: at most the sum of their distances to float64
    off = [name for name, (loss_tol, grad_tol) in (
        ('ours_vs_f64', (ours_loss, ours_grad)), ('pr_vs_f64', (pr_loss, pr_grad)),
        ('ours_vs_pr', (ours_loss + pr_loss, ours_grad + pr_grad)))
        if not _within(errs[name], loss_tol, grad_tol)]
    if not off:
        return 'agree', True
    pr_loss_ok = errs['pr_vs_f64']['loss_max_rel'] <= pr_loss
    if 'ours_vs_f64' in off or dtype == torch.float32 or not pr_loss_ok:
        return 'DIFFER: ' + ', '.join(off), False
    worst = {name: max(errs[name]['grad_draft_max_rel'], errs[name]['grad_weight_max_rel'])
             for name in ('ours_vs_f64', 'pr_vs_f64')}
    return (f"ours within float64's tolerance; PR's {dtype} gradients off float64 by "
            f"{worst['pr_vs_f64']:.1e} (ours {worst['ours_vs_f64']:.1e}): its draft logits are "
            f"rounded to {dtype}"), True


def _errors(got, ref) -> Dict[str, float]:
    """Max abs difference of loss and both gradients, and each over the reference's largest
    magnitude (``*_rel``)."""
    out = {}
    for name, a, b in zip(('loss', 'grad_draft', 'grad_weight'), got, ref):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        diff = (a - b).abs().max().item()
        out[f'{name}_max_abs'] = diff
        out[f'{name}_max_rel'] = diff / max(b.abs().max().item(), 1e-300)
    return out


def _within(errs: Dict[str, float], loss_tol: float, grad_tol: float) -> bool:
    return (errs['loss_max_rel'] <= loss_tol and errs['grad_draft_max_rel'] <= grad_tol
            and errs['grad_weight_max_rel'] <= grad_tol)
