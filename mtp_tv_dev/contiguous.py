"""NVIDIA dev's contiguous packed context parallelism, for tests on trees that lack it.

NVIDIA Megatron-LM ``dev`` (d48bd6be0; radixark ``miles-main-20260819`` is rebased on it) has a
second context-parallel layout for packed (THD) rows, ``PackedSeqParams.cp_partition_mode ==
'contiguous'``: rank ``r`` of ``cp`` holds rows ``[r * n, (r + 1) * n)`` of the whole packed row,
``n = total / cp`` (``get_cp_slice_for_thd``), sequences cut wherever a shard ends. Its
``GPTModel`` builds one ``MTPSequenceRollContext`` per microbatch
(``prepare_mtp_sequence_roll_context``), prefetches ``mtp_num_layers + 1`` successor rows of
labels, loss mask and input ids from the next rank (``prefetch_halos``; rows past the end of the
sequence that holds the shard's last row are set to the field's fill value, 0), and hands it to
``process_mtp_loss(..., sequence_roll_context=)``, whose ``roll_tensor`` calls name the field and
the roll depth: a roll then fills the shard's last row from halo row ``roll_depth`` and zeroes
every row whose successor is in another sequence.

megatron-core 0.19.2 has none of this. This module rebuilds it from dev's semantics (its own
code, not dev's): :func:`prepare_roll_context` (a duck-typed ``ContiguousPackedCPRollContext``
with dev's attributes: ``plan`` and ``halos``), :func:`roll_tensor` (dev's list form, contiguous
packed layout only) and :func:`dev_process_mtp_loss` (``process_mtp_loss`` with dev's
``sequence_roll_context`` parameter, through the plugin's dispatcher). :func:`tree_api` returns
the tree's own functions where it has them (a dev tree), these otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "contiguous_cp_index",
    "prepare_roll_context",
    "roll_tensor",
    "with_extra_parameter",
    "dev_process_mtp_loss",
    "tree_api",
]

#: dev's ``MTPSequenceRollContext`` halo fields; every one fills with 0 here (dev:
#: ``padding_mask`` fills with True, which these tests do not roll).
HALO_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "padding_mask")


def contiguous_cp_index(total: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Indices of the packed row that rank ``cp_rank`` holds in the contiguous layout."""
    if total % cp_size:
        raise ValueError(f"contiguous CP needs total={total} divisible by cp_size={cp_size}")
    n = total // cp_size
    return torch.arange(cp_rank * n, (cp_rank + 1) * n)


@dataclass(frozen=True)
class RollPlan:
    """dev's ``ContiguousPackedSeqRollPlan``: layout facts shared by every roll of a microbatch."""

    invalid_next: torch.Tensor  # [n] bool: the row's successor is in another sequence (or none)
    sequence_length: int
    device: torch.device
    cp_group: object
    recv_rank: Optional[int]  # global rank of the next shard (None on the last rank)
    send_rank: Optional[int]  # global rank of the previous shard (None on the first rank)
    has_sequences: bool
    right_halo_valid_count: torch.Tensor  # successors of the last row still in its sequence


@dataclass(frozen=True)
class RollHalos:
    """dev's ``ContiguousPackedCPRollHalos``: ``[..., width]`` successor rows per field."""

    input_ids: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None

    @property
    def width(self) -> int:
        return next(getattr(self, f) for f in HALO_FIELDS if getattr(self, f) is not None).size(-1)

    def get(self, field: str) -> Optional[torch.Tensor]:
        if field not in HALO_FIELDS:
            raise ValueError(f"halo field {field!r}; expected one of {HALO_FIELDS}")
        return getattr(self, field)


@dataclass(frozen=True)
class RollContext:
    """dev's ``ContiguousPackedCPRollContext`` (``plan``, ``halos``, ``prefetch_halos``)."""

    plan: RollPlan
    halos: Optional[RollHalos] = None

    def prefetch_halos(self, width: int, **fields) -> "RollContext":
        """The first ``width`` rows of each given field on the next rank, sanitised."""
        present = {f: t for f, t in fields.items() if t is not None}
        unknown = sorted(set(present) - set(HALO_FIELDS))
        if unknown:
            raise ValueError(f"halo fields {unknown}; expected some of {HALO_FIELDS}")
        if not present or width > self.plan.sequence_length:
            return self  # dev: one exchange cannot reach two shards away; rolls use P2P
        received = _exchange_first_rows(list(present.values()), width, self.plan)
        invalid = torch.arange(width) >= self.plan.right_halo_valid_count
        halos = {f: h.masked_fill(invalid, 0) for f, h in zip(present, received)}
        return RollContext(self.plan, RollHalos(**halos))


def _cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The physical (padded, where given) sequence boundaries, as dev's rolls use them."""
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return (cu if cu is not None else packed_seq_params.cu_seqlens_q).to("cpu", torch.long)


def _plan(tensor: torch.Tensor, packed_seq_params, cp_group) -> RollPlan:
    n = tensor.size(-1)
    rank, cp = cp_group.rank(), cp_group.size()
    cu = torch.unique_consecutive(_cu_seqlens(packed_seq_params))
    positions = rank * n + torch.arange(n)
    seq_end = cu[1:][torch.bucketize(positions, cu[1:], right=True).clamp(max=cu.numel() - 2)]
    valid_next = (positions < cu[-1]) & (positions + 1 < seq_end)
    tail = positions[-1]
    valid_count = (seq_end[-1] - tail - 1).clamp(min=0) if tail < cu[-1] else torch.tensor(0)
    ranks = dist.get_process_group_ranks(cp_group)
    return RollPlan(
        invalid_next=~valid_next, sequence_length=n, device=tensor.device, cp_group=cp_group,
        recv_rank=ranks[rank + 1] if rank < cp - 1 else None,
        send_rank=ranks[rank - 1] if rank > 0 else None,
        has_sequences=cu.numel() > 1, right_halo_valid_count=valid_count,
    )


def _exchange_first_rows(tensors: List[torch.Tensor], width: int, plan: RollPlan):
    """Send each tensor's first ``width`` rows to the previous shard; receive the next's (zeros
    on the last rank)."""
    received = [t.new_zeros(*t.shape[:-1], width) for t in tensors]
    ops = []
    if plan.recv_rank is not None:
        ops += [dist.P2POp(dist.irecv, r, plan.recv_rank, plan.cp_group) for r in received]
    if plan.send_rank is not None:
        ops += [dist.P2POp(dist.isend, t[..., :width].contiguous(), plan.send_rank, plan.cp_group)
                for t in tensors]
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
    return received


def _is_contiguous(cp_group, packed_seq_params) -> bool:
    return (
        packed_seq_params is not None and cp_group is not None and cp_group.size() > 1
        and getattr(packed_seq_params, "cp_partition_mode", "zigzag") == "contiguous"
    )


def prepare_roll_context(tensor, cp_group, packed_seq_params) -> Optional[RollContext]:
    """dev's ``prepare_mtp_sequence_roll_context``: a context for contiguous packed CP, else None."""
    if not _is_contiguous(cp_group, packed_seq_params):
        return None
    return RollContext(_plan(tensor, packed_seq_params, cp_group))


def roll_tensor(tensors, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None,
                fill_values=None, roll_context=None, sequence_fields=None, roll_depth=0):
    """dev's list-form ``roll_tensor`` for the contiguous packed layout (the only one here).

    Each tensor ``[..., n]`` moves one row left; the shard's last row takes halo row
    ``roll_depth`` of its field when the context holds halos for every field of the call, else
    the next shard's first row (one send/receive); then every row whose successor lies in another
    sequence takes the fill value.
    """
    if shifts != -1 or dims not in (-1, tensors[0].dim() - 1):
        raise ValueError(f"shifts={shifts}, dims={dims}: only a one-row left roll on the last dim")
    if not _is_contiguous(cp_group, packed_seq_params):
        raise ValueError("this stand-in rolls only contiguous packed context parallelism")
    fill_values = fill_values or [0] * len(tensors)
    plan = roll_context.plan if roll_context is not None else _plan(
        tensors[0], packed_seq_params, cp_group)
    halos = roll_context.halos if roll_context is not None else None
    if halos is not None and sequence_fields and all(halos.get(f) is not None
                                                     for f in sequence_fields):
        tails = [halos.get(f)[..., roll_depth] for f in sequence_fields]
    else:
        tails = [r[..., 0] for r in _exchange_first_rows(tensors, 1, plan)]
    out = []
    for tensor, tail, fill in zip(tensors, tails, fill_values):
        rolled = torch.roll(tensor, -1, -1)
        rolled[..., -1] = tail
        rolled[..., plan.invalid_next] = fill
        out.append(rolled)
    return out


def with_extra_parameter(fn: Callable, name: str) -> Callable:
    """``fn`` with one more keyword parameter ``name`` (default None) that it drops."""
    sig = inspect.signature(fn)
    new_sig = sig.replace(parameters=[
        *sig.parameters.values(),
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ])

    def wrapper(*args, **kwargs):
        bound = new_sig.bind(*args, **kwargs)
        bound.arguments.pop(name, None)
        return fn(**bound.arguments)

    wrapper.__signature__ = new_sig
    return wrapper


def _dev_roll(tensor, field, depth, roll_tensor, cp_group, packed_seq_params, roll_context):
    """The MTP losses' roll (:data:`megatron.mtp_tv.mtp_loss.RollFn`) as dev's
    ``process_mtp_loss`` rolls: the list form, naming the field and the roll depth."""
    context = {} if roll_context is None else dict(
        roll_context=roll_context, sequence_fields=[field], roll_depth=depth)
    (rolled,) = roll_tensor([tensor], shifts=-1, dims=-1, cp_group=cp_group,
                            packed_seq_params=packed_seq_params, **context)
    return rolled, rolled.sum()


def dev_mtp_loss_inputs(mtp, sequence_roll_context=None, **process_mtp_loss_kwargs):
    """dev's ``mtp_loss_inputs``: the tree's own where it takes ``sequence_roll_context``,
    otherwise the tree's inputs, with :func:`_dev_roll` where a test put dev's list-form
    ``roll_tensor`` in the module."""
    if "sequence_roll_context" in inspect.signature(mtp.mtp_loss_inputs).parameters:
        return mtp.mtp_loss_inputs(**process_mtp_loss_kwargs,
                                   sequence_roll_context=sequence_roll_context)
    if "sequence_fields" not in inspect.signature(mtp.roll_tensor).parameters:
        if sequence_roll_context is not None:
            raise ValueError("a sequence_roll_context needs dev's list-form roll_tensor")
        return mtp.mtp_loss_inputs(**process_mtp_loss_kwargs)
    roll = functools.partial(
        _dev_roll, roll_tensor=mtp.roll_tensor,
        cp_group=process_mtp_loss_kwargs.get("cp_group"),
        packed_seq_params=process_mtp_loss_kwargs.get("packed_seq_params"),
        roll_context=sequence_roll_context)
    return dataclasses.replace(mtp.mtp_loss_inputs(**process_mtp_loss_kwargs), roll=roll)


def dev_process_mtp_loss(mtp) -> Callable:
    """``process_mtp_loss`` taking ``sequence_roll_context``: the tree's own when it has one (dev,
    plugin or patch mode); otherwise dev's around the tree's function: the MTP losses roll
    through the module's (list-form) ``roll_tensor`` with the context, and Megatron's own CE is
    not called with it, as on dev."""
    if "sequence_roll_context" in inspect.signature(mtp.process_mtp_loss).parameters:
        return mtp.process_mtp_loss
    from megatron.mtp_tv.config import runs_megatron_ce
    from megatron.mtp_tv.mtp_loss import process_mtp_tv_loss

    megatron_process_mtp_loss = inspect.unwrap(mtp.process_mtp_loss)

    def process_mtp_loss(hidden_states, sequence_roll_context=None, **kwargs):
        inputs = dev_mtp_loss_inputs(mtp, sequence_roll_context, **kwargs)
        config = kwargs["config"]
        if runs_megatron_ce(config):
            if kwargs["is_training"] and config.mtp_log_acceptance:
                process_mtp_tv_loss(hidden_states, inputs)
            return megatron_process_mtp_loss(hidden_states=hidden_states, **kwargs)
        main, loss = process_mtp_tv_loss(hidden_states, inputs)
        return main if loss is None else mtp.MTPLossAutoScaler.apply(main, loss)

    return process_mtp_loss


@dataclass
class TreeAPI:
    """What a test needs to drive contiguous packed CP on this tree."""

    prepare: Callable  # prepare_mtp_sequence_roll_context(tensor, cp_group, packed_seq_params)
    roll_tensor: Callable  # the list form
    process_mtp_loss: Callable  # with sequence_roll_context
    native: bool  # the tree's own (NVIDIA dev) rather than this module's stand-ins


def tree_api(mtp) -> TreeAPI:
    """The tree's contiguous-CP functions (a dev tree), or this module's stand-ins."""
    prepare = getattr(mtp, "prepare_mtp_sequence_roll_context", None)
    if prepare is not None:
        return TreeAPI(prepare, mtp.roll_tensor, dev_process_mtp_loss(mtp), True)
    return TreeAPI(prepare_roll_context, roll_tensor, dev_process_mtp_loss(mtp), False)
