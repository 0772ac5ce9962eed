"""What the benchmark measures: one :class:`Case` per implementation and shape, and the builders
of each row group's cases (``loss``: the per-depth loss against matmul + Megatron's CE, and the
matrix products alone; ``mtp`` and ``wide``: Megatron's ``process_mtp_loss`` through the
plugin; ``step``: a real GPTModel's ``_postprocess``), and what the measured loss code is
(:func:`loss_mode`, :func:`tv_target_source`).
"""

import gc
import importlib
import importlib.util
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .memory import LiveBytesTracker, SavedTensorsCounter

#: MTP-path cases beside the depth-1 'tv' row: the cold-start losses and the default chunk.
EXTRA_MTP_TYPES = ('kl', 'lk', 'nla')
#: The 'step' rows' TV losses beside 'ce' ('e2e_tv' is added with more than one depth).
STEP_TYPES = ('tv', 'kl', 'lk')
#: The 'wide' rows (the MTP path at large hidden sizes).
WIDE_IMPLS = ('ce', 'tv', 'tv-own', 'kl')
#: The 'ce' rows: Megatron's MTP cross-entropy and the same loss through the chunked sweep.
CE_IMPLS = ('ce', 'ce-chunked')
#: Std of the logits the benchmark's output weights give unit-variance hidden states (a
#: trained model's range): far smaller ones make every loss trivially flat, far larger ones
#: push probabilities and logit gradients towards subnormals, on which x86 GEMMs crawl.
LOGIT_STD = 2.5

#: Where a patched megatron-core tree has the loss package (patch mode, ``patches/``).
PATCHED_PACKAGE = 'megatron.core.transformer.mtp_tv'
PLUGIN_PACKAGE = 'megatron.mtp_tv'


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def loss_mode() -> str:
    """``'patch'`` when the imported megatron-core has the losses natively (a patched tree on
    ``PYTHONPATH``), else ``'plugin'`` (this checkout's package, installed by ``install()``)."""
    return 'patch' if _module_exists(PATCHED_PACKAGE) else 'plugin'


def loss_package() -> str:
    """The module name of the loss code this run measures (see :func:`loss_mode`)."""
    return PATCHED_PACKAGE if loss_mode() == 'patch' else PLUGIN_PACKAGE


def loss_module(name: str):
    """``<measured package>.<name>``, e.g. ``loss_module('mtp_loss')``."""
    return importlib.import_module(f'{loss_package()}.{name}')


def prepare_losses() -> str:
    """Make ``mtp_loss_type`` work in this process: ``install()`` the plugin in plugin mode,
    nothing in patch mode (the tree has it natively). Returns the mode."""
    mode = loss_mode()
    if mode == 'plugin':
        import megatron.mtp_tv

        megatron.mtp_tv.install()
    return mode


def tv_target_source() -> str:
    """Where the measured TV losses take their target distribution from: ``'main logits'`` when
    the loss package can attach its loss to the main head's logits (``attach_mtp_tv_loss``), else
    ``'own projection'`` (they project the detached main hidden states themselves, one more
    ``[tokens x h x V/tp]`` product per chunk pass)."""
    import importlib

    reads_logits = hasattr(importlib.import_module(f'{loss_package()}.mtp_loss'), 'attach_mtp_tv_loss')
    return 'main logits' if reads_logits else 'own projection'


def auto_chunk(num_tokens: int, depths: int, hidden: int, vocab_local: int,
               target_rows: bool = True) -> Optional[int]:
    """The chunk ``mtp_tv_chunk=0`` picks in the measured code (None if it has no such rule);
    ``target_rows=False``: cross-entropy against the labels (``mtp_ce_chunked``)."""
    rule = getattr(loss_module('linear_tv'), 'auto_chunk_tokens', None)
    if rule is None:
        return None
    kwargs = {} if target_rows else {'target_rows': False}
    return int(rule(num_tokens, depths, hidden, vocab_local, **kwargs))


class Case:
    """One implementation at one shape: ``step()`` runs forward+backward and drops the result.

    ``forward()`` returns the tensor whose ``.sum().backward()`` is the backward pass; ``reset()``
    clears the gradients of the leaves (outside the timed region).
    """

    def __init__(self, forward: Callable[[], torch.Tensor], leaves: List[torch.Tensor]):
        self.forward = forward
        self.leaves = leaves

    def reset(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None

    def step(self) -> None:
        self.forward().sum().backward()

    def memory(self) -> Dict[str, float]:
        """Peak extra bytes of fwd+bwd and bytes saved for backward (one untimed run)."""
        self.reset()
        gc.collect()
        tracker = LiveBytesTracker()
        with tracker:
            tracker.mark('forward')
            with SavedTensorsCounter(tracker) as saved:
                out = self.forward().sum()
            tracker.mark('backward')
            out.backward()
            del out
        peak, saved_bytes = tracker.peak, saved.bytes
        fwd_peak, bwd_peak = tracker.phase_peak('forward'), tracker.phase_peak('backward')
        denormal = max(_denormal_fraction(leaf.grad) for leaf in self.leaves)
        self.reset()
        return {'peak': peak, 'fwd_peak': fwd_peak, 'bwd_peak': bwd_peak, 'saved': saved_bytes,
                'saved_tensors': saved.tensors, 'denormal_grad_fraction': denormal}


def _denormal_fraction(grad: Optional[torch.Tensor]) -> float:
    """Share of subnormal values in ``grad``: x86 GEMMs on them run many times slower, so a
    benchmark whose gradients are full of them measures the FPU, not the loss."""
    if grad is None or not grad.is_floating_point():
        return 0.0
    tiny = torch.finfo(grad.dtype).tiny
    g = grad.detach().abs()
    return float(((g < tiny) & (g > 0)).float().mean())


def ce_baseline(tp_group=None):
    """The CE baseline of every benchmark: ``(ce, name)``, ``ce(hidden, weight, labels)`` the
    per-token loss of ``logits = hidden @ weight^T`` (``[..., V/tp]``) under Megatron's
    ``vocab_parallel_cross_entropy``. Without megatron-core there is no baseline: an ImportError
    (a ratio to another cross-entropy would be a comparison with something else).

    ``tp_group``: the vocabulary's group; None takes Megatron's tensor-parallel group when its
    parallel state is initialised (``single_process()``), else the world, a world of one made
    here if there is none (an in-process store: no port another process on the machine may hold).
    """
    import torch.distributed as dist

    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except ImportError as error:
        raise ImportError(f"the benchmarks' baseline is Megatron's vocab_parallel_cross_entropy, "
                          f"which does not import ({error}): install megatron-core and its "
                          f"imports (numpy, packaging)") from error

    if tp_group is None:
        from megatron.core import parallel_state

        if not dist.is_initialized():
            backend = 'nccl' if torch.cuda.is_available() else 'gloo'
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            tp_group = dist.group.WORLD

    def megatron_ce(hidden, weight, labels):
        logits = torch.matmul(hidden, weight.t())
        return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)
    return megatron_ce, 'megatron vocab_parallel_cross_entropy'


def loss_cases(s: int, h: int, V: int, chunk: int, tp_group, tp_rank: int, tp: int,
               seed: int = 0) -> Dict[str, Case]:
    """Per-depth loss on one depth: CE (:func:`ce_baseline`) vs TV."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    linear_tv_loss = loss_module('linear_tv').linear_tv_loss
    MTPLossOptions = importlib.import_module(loss_package()).MTPLossOptions  # noqa: N806  (the class)

    b = 1
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).requires_grad_()
    # The target: another hidden state, close enough that p and q overlap (alpha ~ 0.5).
    target = hidden.detach() + torch.randn(s, b, h, generator=g)
    full_weight = torch.randn(V, h, generator=g) * 0.02 * 4  # logits std ~ 2.5 at h=1024
    shard = V // tp
    weight = full_weight[tp_rank * shard : (tp_rank + 1) * shard].clone().requires_grad_()
    del full_weight
    labels = torch.randint(0, V, (s, b), generator=g)
    ce_weights = torch.full((s, b), 1.0 / (s * b))
    tv_weights = torch.full((1, s, b), 1.0 / (s * b))

    def into_tp(x):
        return copy_to_tensor_model_parallel_region(x, tp_group) if tp > 1 else x

    ce_loss, _ = ce_baseline(tp_group)

    def ce():
        return ce_loss(into_tp(hidden), weight, labels) * ce_weights

    def tv():
        draft = into_tp(hidden).unsqueeze(0)
        return linear_tv_loss(draft, target, weight, tv_weights,
                              MTPLossOptions('tv', chunk_size=chunk),
                              tp_group=tp_group if tp > 1 else None).loss

    def ce_products():
        return _CEProducts.apply(into_tp(hidden).view(s * b, h), weight)

    def tv_products():
        draft = into_tp(hidden).view(s * b, h)
        return _TVProducts.apply(draft, target.view(s * b, h), weight, max(1, chunk // b) * b)

    leaves = [hidden, weight]
    return {'ce': Case(ce, leaves), 'tv': Case(tv, leaves),
            # The matrix products alone, same shapes, nothing else: the floor of each side.
            'ce-products': Case(ce_products, leaves), 'tv-products': Case(tv_products, leaves)}


class _CEProducts(torch.autograd.Function):
    """CE's three products: ``z = x W^T`` (materialised, as CE does), then ``g x``-side and
    ``g^T x`` with ``g = z`` standing in for the logit gradient (same shape, no softmax)."""

    @staticmethod
    def forward(ctx, x, weight):
        z = x @ weight.t()
        ctx.save_for_backward(x, weight, z)
        return z.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        x, weight, z = ctx.saved_tensors
        return z @ weight, z.t() @ x


class _TVProducts(torch.autograd.Function):
    """The fused TV sweep's four products per chunk (target and draft rows in one projection
    into a reused buffer, ``g @ W`` and ``g^T x`` in forward) with the draft logits standing in
    for the logit gradient: what the sweep costs with free row passes."""

    @staticmethod
    def forward(ctx, draft, target, weight, chunk):
        n_tok, h = draft.shape
        grad_x, grad_w = torch.empty_like(draft), torch.empty_like(weight)
        inputs = draft.new_empty(2 * chunk + 1, h)
        logits = draft.new_empty(2 * chunk + 1, weight.shape[0])
        for start in range(0, n_tok, chunk):
            stop = min(start + chunk, n_tok)
            n, n_t = stop - start, min(stop + 1, n_tok) - (start + 1)
            x = draft[start:stop]
            m = n_t + n
            torch.cat([target[start + 1 : start + 1 + n_t], x], out=inputs[:m])
            torch.mm(inputs[:m], weight.t(), out=logits[:m])
            g = logits[n_t:m]
            torch.mm(g, weight, out=grad_x[start:stop])
            grad_w.addmm_(g.t(), x, beta=1.0 if start else 0.0)
        ctx.save_for_backward(grad_x, grad_w)
        return draft.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x.mul_(grad), grad_w.mul_(grad), None, None, None


class _LanguageModelStub:
    """What ``process_mtp_loss`` needs of a GPTModel: ``compute_language_model_loss``.

    Calls ``LanguageModule.compute_language_model_loss`` itself (Megatron's code: vocab-parallel
    CE, or the fused one when ``config.cross_entropy_loss_fusion``).
    """

    def __init__(self, config, tp_group):
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        self.tp_group = tp_group
        self.pg_collection = ProcessGroupCollection(tp=tp_group)

    def compute_language_model_loss(self, labels, logits):
        from megatron.core.models.common.language_module.language_module import LanguageModule

        return LanguageModule.compute_language_model_loss(self, labels, logits)


def mtp_cases(G: int, s: int, h: int, V: int, chunk: int, tp_group, tp: int,
              tv_type: str, seed: int = 0, weight_scale: float = 0.08,
              impls: Optional[Sequence[str]] = None) -> Dict[str, Case]:
    """Megatron's MTP loss path, ``process_mtp_loss`` via the plugin dispatcher.

    ``weight_scale``: std of the output weight (0.08: logits std ~ 2.5 at h=1024, the 'mtp' rows;
    the 'wide' rows pass ``LOGIT_STD / sqrt(h)``). ``impls``: keep only these cases.
    """
    from megatron.core.models.gpt import gpt_model
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    prepare_losses()

    def config(loss_type, chunk=chunk, **fields):
        return TransformerConfig(
            num_layers=1, hidden_size=h, num_attention_heads=8, mtp_num_layers=G,
            tensor_model_parallel_size=tp, use_cpu_initialization=True,
            params_dtype=torch.float32, mtp_loss_type=loss_type, mtp_tv_chunk=chunk,
            **fields,
        )

    ce_config = config('ce')
    # The weight must not share a seed with the hidden states below: the same normal draws in
    # both make W's first rows copies of the hidden rows, logits of ~80, probabilities below
    # 1e-38 and gradient GEMMs on denormals (50x slower on x86).
    torch.manual_seed(seed + 7919)
    output_layer = ColumnParallelLinear(
        h, V, config=ce_config, init_method=torch.nn.init.normal_, bias=False,
        skip_bias_add=False, gather_output=False, tp_group=tp_group,
    )
    with torch.no_grad():
        output_layer.weight.mul_(weight_scale)  # 0.08: logits std ~ 2.5 at h=1024, as 'loss'
    b = 1
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(s, b, h, generator=g)
    drafts = [main + torch.randn(s, b, h, generator=g) for _ in range(G)]
    hidden = torch.cat([main] + drafts).requires_grad_()  # [(1+G)*s, b, h]
    del main, drafts
    labels = torch.randint(0, V, (b, s), generator=g)
    loss_mask = torch.ones(b, s)

    # The main head's logits of the main hidden states: GPTModel._postprocess computes them for
    # the main loss right after the MTP loss, and the TV losses read their target from them
    # (megatron.mtp_tv.mtp_loss.attach_mtp_tv_loss). They exist in the step whatever the MTP loss, so they are
    # made here, outside the measured region, and handed over as _postprocess hands them.
    main_logits = None
    if tv_target_source() == 'main logits':
        with torch.no_grad():
            main_logits, _ = output_layer(hidden[:s].detach())

    def run(cfg, from_main_logits=True):
        stub = _LanguageModelStub(cfg, tp_group)
        kwargs = dict(
            hidden_states=hidden, labels=labels, loss_mask=loss_mask,
            output_layer=output_layer, output_weight=None, runtime_gather_output=None,
            is_training=True, compute_language_model_loss=stub.compute_language_model_loss,
            config=cfg, cp_group=None, tp_group=tp_group, packed_seq_params=None,
        )
        if cfg.mtp_loss_type != 'ce' and from_main_logits and main_logits is not None:
            mtp_loss = loss_module('mtp_loss')
            from megatron.core.transformer import multi_token_prediction as mtp_module

            def on_main_logits():  # what GPTModel._postprocess does, its main head projected
                main, drafts = mtp_loss.split_mtp_hidden_states(kwargs['hidden_states'], cfg)
                rest = {k: v for k, v in kwargs.items() if k != 'hidden_states'}
                # a fresh tensor object each step, as the model's main head gives: the loss is
                # attached to the logits in place (their storage is shared, nothing is copied)
                inputs = mtp_module.mtp_loss_inputs(**rest)
                return mtp_loss.attach_mtp_tv_loss(
                    main_logits.detach(), main, drafts, inputs, mtp_module.MTPLossAutoScaler)

            return on_main_logits
        return lambda: gpt_model.process_mtp_loss(**kwargs)

    leaves = [hidden, output_layer.weight]
    tv_config = config(tv_type)
    cases = {
        'ce': Case(run(ce_config), leaves),
        tv_type: Case(run(tv_config), leaves),
    }
    if main_logits is not None:  # the fallback: the loss projects its own target
        cases[f'{tv_type}-own'] = Case(run(tv_config, False), leaves)
    # 'ce' through the chunked sweep (mtp_ce_chunked): Megatron's objective at bounded memory.
    cases['ce-chunked'] = Case(run(config('ce', mtp_ce_chunked=True)), leaves)
    if G == 1:
        for loss_type in EXTRA_MTP_TYPES:
            cases[loss_type] = Case(run(config(loss_type)), leaves)
        if chunk != 0:  # mtp_tv_chunk=0 is the default: what a user who sets nothing gets
            cases[f'{tv_type}-auto'] = Case(run(config(tv_type, 0)), leaves)
    if impls is not None:
        cases = {name: case for name, case in cases.items() if name in impls}
    return cases


def step_heads(h: int) -> int:
    """Attention heads of the 'step' model's MTP layers: 128-wide heads where ``h`` allows."""
    for width in (128, 64):
        if h % width == 0 and h >= width:
            return h // width
    return 1


def step_cases(G: int, s: int, h: int, V: int, seed: int = 0,
               types: Optional[Sequence[str]] = None) -> Dict[str, Case]:
    """What a user pays past the decoder: ``GPTModel._postprocess`` forward+backward.

    One real megatron-core GPTModel (local spec, rope, untied output layer, ``mtp_num_layers=G``,
    one decoder layer that is never run) serves every case; each case sets
    ``model.config.mtp_loss_type`` before its forward, so all of them run the same weights, and
    only one model is in memory. The decoder output is a leaf ``[s, 1, h]`` (unit variance, as
    after the decoder's final norm); ``_postprocess`` runs the MTP layer(s) on it, the MTP loss
    (``process_mtp_loss`` through the dispatcher), the main logits and the main CE. The
    forward returns the masked mean of the main per-token loss (the MTP loss rides on it through
    ``MTPLossAutoScaler``), as a training step's loss function does. The output weight is drawn
    with std ``LOGIT_STD / sqrt(h)`` (logits std ~ 2.5 on the normalised hidden states), from a
    seed the hidden states do not share. ``mtp_tv_chunk`` is the default 0 (automatic).
    """
    from mtp_tv_dev.cpu import causal_attention_mask
    from mtp_tv_dev.models import build_gpt_with_mtp

    prepare_losses()
    if types is None:
        types = STEP_TYPES + (('e2e_tv',) if G > 1 else ())
    model = build_gpt_with_mtp(
        vocab_size=V, hidden_size=h, num_layers=1, mtp_num_layers=G, seq_length=s,
        num_attention_heads=step_heads(h), tie_embeddings=False, position_embedding_type='rope',
        seed=seed + 104729, mtp_loss_type='ce', mtp_tv_chunk=0,
    )
    model.train()
    weight = model.output_layer.weight
    with torch.no_grad():
        weight.normal_(0.0, LOGIT_STD / math.sqrt(h),
                       generator=torch.Generator().manual_seed(seed + 7919))
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, 1, h, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (1, s + 1), generator=g)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(s).unsqueeze(0)
    loss_mask = torch.ones(1, s)
    attention_mask = causal_attention_mask(s)
    # As GPTModel._preprocess computes it, outside the timed region (it precedes the decoder).
    rotary_pos_emb = model.rotary_pos_emb(model.rotary_pos_emb.get_rotary_seq_len(
        None, model.decoder, hidden, model.config, None))

    def run(loss_type):
        def forward():
            model.config.mtp_loss_type = loss_type
            loss = model._postprocess(
                hidden_states=hidden, input_ids=input_ids, position_ids=position_ids,
                labels=labels, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=None,
                rotary_pos_sin=None, mtp_in_postprocess=True, loss_mask=loss_mask,
                attention_mask=attention_mask,
            )
            return (loss * loss_mask).sum() / loss_mask.sum()
        return forward

    leaves = [hidden] + [p for p in model.parameters() if p.requires_grad]
    cases = {'ce': Case(run('ce'), leaves)}
    for loss_type in types:
        cases[loss_type] = Case(run(loss_type), leaves)
    return cases
