"""The route plan of one call: who sends which rows where, computed identically on every rank.

One small all-gather carries every rank's per-chunk expert counts and its input
problems, so validation failures are raised with the same error on every rank before
any token moves, and no rank is left inside a collective. The same counts tell every
rank how to split a call whose rows exceed a bounded receive capacity into waves:
each wave fits the receive buffer on every rank, and the waves run one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

_OK = 0
_BAD_INPUT = 1


@dataclass(frozen=True)
class ChunkRoute:
    """Routing of one piece of a call: a chunk of tokens (chunks overlap one's communication
    with another's compute), or the part of such a chunk that one wave carries."""

    order: torch.Tensor  # [n] flattened (token, k) rows of the call sent here, sorted by expert (stable)
    source_token: torch.Tensor  # [n] the token of each sorted row
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    expert_counts: list[int]  # rows per local expert after dispatch
    expert_offsets: torch.Tensor  # int32 end offsets of expert_counts, on the rows' device
    recv_to_expert: torch.Tensor | None  # [expert-major row] -> its received (source-major) row
    expert_to_recv: torch.Tensor | None  # the inverse: [received row] -> its expert-major row
    send_begin: int  # first row of this piece in the send-side workspace buffer
    recv_begin: int  # first row of this piece in the receive-side workspace buffer (per wave)
    wave: int = 0  # pieces of one wave share the receive buffer; waves run one after another
    saved_begin: int = 0  # first row of this piece among all rows this rank computes in the call

    @property
    def send_rows(self) -> int:
        return self.order.numel()

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


@dataclass(frozen=True)
class GradNeeds:
    """What this rank's call will need in backward (known at forward time)."""

    recording: bool = False  # autograd records this call at all
    hidden: bool = False  # hidden_states wants a gradient
    expert_weights: bool = False  # gate_up or down wants a gradient
    route_weights: bool = False  # topk_weights wants a gradient (taken on the expert side)


@dataclass(frozen=True)
class RoutePlan:
    num_tokens: int
    top_k: int
    chunks: tuple[ChunkRoute, ...]  # every piece, wave by wave
    recv_rows: int  # rows this rank receives over all pieces (what its experts compute)
    max_recv_rows: int  # the largest receive count of any EP rank
    waves: int = 1  # more than one only when a bounded capacity is exceeded
    backward_dispatch: bool = False  # some EP rank needs expert-side gradients
    backward_combine: bool = False  # some EP rank needs the hidden-state gradient
    backward_route_weights: bool = False  # some EP rank needs the route weights' gradient
    # [(token, k) row] -> its row among every piece's sorted rows in piece order (the send-side
    # buffer): un-permutes the returned rows with one gather
    unsort: torch.Tensor | None = None


@dataclass(frozen=True)
class RoutingSetup:
    """The static facts a plan needs: fixed per module, so built once."""

    num_experts: int
    top_k: int
    max_tokens: int
    ep_size: int
    ep_rank: int
    group: dist.ProcessGroup | None
    chunks: int
    capacity_rows: int
    capacity_description: str

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


def is_integer_tensor(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


# The header every EP rank sends: host facts, then what this rank's topk_ids say (computed on
# their device, read on the host only once the whole header has been gathered).
_FIXED = 6  # status, tokens, autograd records; hidden, expert weights, route weights want a gradient
_LOW, _HIGH, _MISMATCH = _FIXED, _FIXED + 1, _FIXED + 2  # id range, tokens_per_expert differs
_COUNTS = _FIXED + 3  # then the [chunk, expert] row counts


@dataclass(frozen=True)
class _LocalRoute:
    """This rank's routing before the exchange, all on topk_ids' device (nothing read yet)."""

    checked: torch.Tensor  # int64 [lowest id, highest id, tokens_per_expert differs, counts...]
    order: torch.Tensor  # the (token, k) rows sorted by (chunk, expert), stable


def _host_problems(setup: RoutingSetup, topk_ids: torch.Tensor, num_tokens: int,
                   tokens_per_expert: torch.Tensor | None) -> list[str]:
    """What is wrong with the inputs from their metadata alone (no data is read)."""
    if not is_integer_tensor(topk_ids):
        return [f"topk_ids must be an integer tensor, got dtype={topk_ids.dtype}"]
    if tuple(topk_ids.shape) != (num_tokens, setup.top_k):
        return [f"topk_ids must have shape [{num_tokens}, {setup.top_k}] (tokens, top_k), "
                f"got {list(topk_ids.shape)}"]
    problems = []
    if num_tokens > setup.max_tokens:
        problems.append(f"{num_tokens} tokens exceed local_num_tokens={setup.max_tokens}")
    if tokens_per_expert is not None and tokens_per_expert.numel() != setup.num_experts:
        problems.append(f"tokens_per_expert={tokens_per_expert.reshape(-1).tolist()} does not match "
                        f"the counts of topk_ids (it needs {setup.num_experts} values)")
    return problems


def _local_route(setup: RoutingSetup, topk_ids: torch.Tensor, num_tokens: int,
                 tokens_per_expert: torch.Tensor | None) -> _LocalRoute:
    """Counts, sort order and the data checks, without reading anything on the host: the
    id range and the ``tokens_per_expert`` comparison travel in the header and are judged
    once it is gathered. Counts come from the sorted keys (``searchsorted``), never from a
    ``bincount`` or scatter indexed by the ids, so out-of-range ids cannot write out of
    bounds before they are rejected (and CUDA's ``bincount`` would read its input's max on
    the host)."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    low_high = torch.stack(ids.aminmax()) if ids.numel() else ids.new_zeros(2)
    keys = ids if setup.chunks == 1 else (
        _chunk_of_rows(num_tokens, setup.top_k, setup.chunks, device) * setup.num_experts + ids)
    sorted_keys, order = torch.sort(keys, stable=True)
    width = setup.chunks * setup.num_experts
    counts = torch.searchsorted(sorted_keys, torch.arange(width + 1, device=device)).diff()
    mismatch = ids.new_zeros(1)
    if tokens_per_expert is not None:
        total = counts.view(setup.chunks, setup.num_experts).sum(0)
        mismatch = (tokens_per_expert.reshape(-1).to(total) != total).any().to(torch.int64).reshape(1)
    return _LocalRoute(checked=torch.cat([low_high, mismatch, counts]), order=order)


def _ids_out_of_range(setup: RoutingSetup, row: list[int]) -> bool:
    return row[_LOW] < 0 or row[_HIGH] >= setup.num_experts


def _rejected(setup: RoutingSetup, row: list[int]) -> bool:
    """Whether a rank's gathered header row rejects its call."""
    return row[0] != _OK or _ids_out_of_range(setup, row) or bool(row[_MISMATCH])


def _data_problems(setup: RoutingSetup, row: list[int], tokens_per_expert: torch.Tensor | None,
                   local: _LocalRoute | None) -> list[str]:
    """What this rank's gathered header row says is wrong with its data (its tensors are read
    again only to word the error)."""
    low, high = row[_LOW], row[_HIGH]
    if _ids_out_of_range(setup, row):
        return [f"topk_ids must lie in [0, {setup.num_experts}), got values in [{low}, {high}]"]
    if row[_MISMATCH]:
        assert tokens_per_expert is not None and local is not None
        total = local.checked[_COUNTS - _FIXED:].view(setup.chunks, setup.num_experts).sum(0)
        return [f"tokens_per_expert={tokens_per_expert.reshape(-1).tolist()} does not match the counts of "
                f"topk_ids {total.tolist()}"]
    return []


def _chunk_of_rows(num_tokens: int, top_k: int, chunks: int, device: torch.device) -> torch.Tensor:
    """The chunk of every (token, k) row: chunk ``c`` holds tokens ``[T*c//C, T*(c+1)//C)``, so
    token ``t`` lies in chunk ``((t+1)*C - 1) // T``; computed where the rows are (no copy)."""
    token = torch.div(torch.arange(num_tokens * top_k, device=device), top_k, rounding_mode="floor")
    return torch.div((token + 1) * chunks - 1, max(num_tokens, 1), rounding_mode="floor")


def _exchange_device(setup: RoutingSetup) -> torch.device:
    if setup.ep_size == 1 or str(dist.get_backend(setup.group)) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None, "a non-gloo backend without an accelerator"
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors (1-D, each keeping its dtype) on ``device``, in one copy that does
    not block the host (pinned, ``non_blocking``): a blocking host->device copy waits for the
    device's stream to drain."""
    if not tensors:
        return []
    packed = torch.cat([t.to(torch.int64) for t in tensors])
    if device.type != "cpu":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    as_dtype = {dtype: packed.to(dtype) for dtype in {t.dtype for t in tensors}}  # one cast per dtype
    parts, begin = [], 0
    for t in tensors:
        parts.append(as_dtype[t.dtype][begin:begin + t.numel()])
        begin += t.numel()
    return parts


def _exchange_header(setup: RoutingSetup, fixed: list[int], checked: torch.Tensor) -> torch.Tensor:
    """All ranks' headers as [ep_size, len] on the host: the call's one device->host read."""
    host_fixed = torch.tensor(fixed, dtype=torch.int64)
    exchange = _exchange_device(setup)
    if exchange.type == "cpu":  # gloo, or one rank: read before sending
        local = torch.cat([host_fixed, checked.cpu()])
    else:  # gathered where the data is, read once gathered
        local = torch.cat([to_device([host_fixed], exchange)[0], checked.to(exchange)])
    if setup.ep_size == 1:
        return local.unsqueeze(0)
    parts = [torch.empty_like(local) for _ in range(setup.ep_size)]
    dist.all_gather(parts, local, group=setup.group)
    return torch.stack(parts).cpu()


def _raise_input_problems(setup: RoutingSetup, statuses: list[int], problems: list[str]) -> None:
    if setup.ep_size == 1:
        everyone: list[list[str]] = [problems]
    else:
        everyone = [[] for _ in range(setup.ep_size)]
        dist.all_gather_object(everyone, problems, group=setup.group)
    lines = [f"EP rank {r}: {p}" for r, rank_problems in enumerate(everyone) for p in rank_problems]
    rejected = ", ".join(str(r) for r, s in enumerate(statuses) if s != _OK)
    raise ValueError(f"MoeExperts input rejected by EP rank(s) {rejected} before any dispatch:\n  "
                     + "\n  ".join(lines))


def _gather_segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + length)`` of every segment, in segment order."""
    total = int(lengths.sum())
    dst_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts - dst_starts, lengths, output_size=total)
    return shift + torch.arange(total)


def _recv_to_expert(per_source: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows received source-major ([source][expert]) into expert-major order."""
    lengths = per_source.reshape(-1)
    source_major_start = (torch.cumsum(lengths, 0) - lengths).view(per_source.shape)
    return _gather_segments(source_major_start.t().reshape(-1), per_source.t().reshape(-1))


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: a gather by ``inv`` undoes a gather by ``perm``, and
    replaces a scatter by ``perm`` (``index_copy_``), which is several times slower on CPU."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def wave_counts(counts_all: torch.Tensor, capacity_rows: int) -> torch.Tensor:
    """Split ``counts_all`` [source, chunk, destination, local expert] into waves
    [wave, source, chunk, destination, local expert] so that no destination receives more
    than ``capacity_rows`` rows in one wave. Each destination takes its rows in receive
    order (chunk, source, expert), ``capacity_rows`` per wave, so a wave holds a contiguous
    run of every (source, chunk, expert) block and the earlier waves hold its first rows."""
    sources, chunks, dests, experts = counts_all.shape
    per_dest = counts_all.permute(2, 1, 0, 3).reshape(dests, -1)
    needed = int(per_dest.sum(1).max()) if per_dest.numel() else 0
    waves = max(1, math.ceil(needed / capacity_rows))
    if waves == 1:
        return counts_all.unsqueeze(0)
    ends = per_dest.cumsum(1)
    starts = ends - per_dest
    low = (torch.arange(waves) * capacity_rows).view(waves, 1, 1)
    taken = (torch.minimum(ends, low + capacity_rows) - torch.maximum(starts, low)).clamp(min=0)
    return taken.view(waves, dests, chunks, sources, experts).permute(0, 3, 2, 1, 4)


def build_route_plan(setup: RoutingSetup, topk_ids: torch.Tensor, num_tokens: int,
                     tokens_per_expert: torch.Tensor | None = None,
                     caller_problems: list[str] | None = None,
                     grad_needs: GradNeeds | None = None) -> RoutePlan:
    """Validate (same error on every rank), exchange counts, derive splits and waves.

    ``caller_problems`` are input errors the caller found (shapes, dtypes): they are
    raised on every EP rank instead of only here, so no rank hangs in the next collective.
    The host reads device data once: the gathered header, which carries the data checks.
    """
    problems = list(caller_problems or [])
    local: _LocalRoute | None = None
    try:
        problems += _host_problems(setup, topk_ids, num_tokens, tokens_per_expert)
        if not problems:
            local = _local_route(setup, topk_ids, num_tokens, tokens_per_expert)
    except Exception as exc:  # an input no check foresaw (sparse, meta): still rejected on every rank
        problems.append(f"topk_ids or tokens_per_expert cannot be read: {type(exc).__name__}: {exc}")
        local = None
    width = setup.chunks * setup.num_experts
    # with problems this rank's tensors may be anywhere (even on meta): its header goes where it can
    checked = (local.checked if local is not None and not problems
               else torch.zeros(_COUNTS - _FIXED + width, dtype=torch.int64, device=_exchange_device(setup)))
    needs = grad_needs or GradNeeds()
    fixed = [_BAD_INPUT if problems else _OK, num_tokens, int(needs.recording), int(needs.hidden),
             int(needs.expert_weights), int(needs.route_weights)]
    gathered = _exchange_header(setup, fixed, checked)
    rows = gathered.tolist()
    problems += _data_problems(setup, rows[setup.ep_rank], tokens_per_expert, local)
    statuses = [_BAD_INPUT if _rejected(setup, row) else _OK for row in rows]
    if any(s != _OK for s in statuses):
        _raise_input_problems(setup, statuses, problems)
    recording = [row[2] for row in rows]
    if len(set(recording)) > 1:
        raise ValueError(
            "MoeExperts: autograd records this call on EP ranks "
            f"{[r for r, v in enumerate(recording) if v]} but not on "
            f"{[r for r, v in enumerate(recording) if not v]}; the backward is collective, so every "
            "EP rank must run the layer with the same grad mode and trainable inputs")
    backward_combine = any(row[3] for row in rows)
    backward_route_weights = any(row[5] for row in rows)
    backward_dispatch = backward_combine or backward_route_weights or any(row[4] for row in rows)

    assert local is not None
    counts_all = gathered[:, _COUNTS:].view(setup.ep_size, setup.chunks, setup.ep_size, setup.local_experts)
    recv_per_rank = counts_all.sum(dim=(0, 1, 3))  # [ep_size] rows each rank receives
    per_wave = wave_counts(counts_all, setup.capacity_rows)
    chunk_routes = _pieces(setup, counts_all, per_wave, local.order)
    # every (token, k) row travels in exactly one piece (lossless)
    unsort = inverse_permutation(torch.cat([route.order for route in chunk_routes]) if chunk_routes
                                 else local.order.new_empty(0))
    return RoutePlan(num_tokens=num_tokens, top_k=setup.top_k, chunks=tuple(chunk_routes),
                     recv_rows=int(recv_per_rank[setup.ep_rank]), max_recv_rows=int(recv_per_rank.max()),
                     waves=per_wave.shape[0],
                     backward_dispatch=backward_dispatch, backward_combine=backward_combine,
                     backward_route_weights=backward_route_weights, unsort=unsort)


def _pieces(setup: RoutingSetup, counts_all: torch.Tensor, per_wave: torch.Tensor,
            order: torch.Tensor) -> list[ChunkRoute]:
    """One route per (wave, chunk) that carries rows anywhere; ``order`` sorts this rank's
    rows by (chunk, expert). Everything is derived on the host from the gathered counts,
    and the index tensors the device needs go there in one non-blocking copy."""
    me = setup.ep_rank
    waves = per_wave.shape[0]
    mine_all = counts_all[me]  # [chunk, destination, local expert]: this rank's sorted rows
    chunk_begin = [0, *mine_all.sum(dim=(1, 2)).cumsum(0).tolist()]
    pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (wave, chunk, mine, per_source)
    to_copy: list[torch.Tensor] = []  # per piece: [wave's part of its chunk,] offsets[, recv_to_expert]
    for w in range(waves):
        for c in range(setup.chunks):
            if waves > 1 and not int(per_wave[w, :, c].sum()):
                continue  # nobody moves a row of this chunk in this wave
            mine = per_wave[w, me, c]  # [destination, local expert]
            per_source = per_wave[w, :, c, me]  # [source, local expert]
            if waves > 1:  # the part of every (destination, expert) block this wave carries
                block = mine_all[c].reshape(-1)
                block_start = torch.cumsum(block, 0) - block + per_wave[:w, me, c].sum(0).reshape(-1)
                to_copy.append(_gather_segments(block_start, mine.reshape(-1)))
            to_copy.append(per_source.sum(0).cumsum(0, dtype=torch.int32))
            if setup.ep_size > 1:
                to_copy.append(_recv_to_expert(per_source))
            pieces.append((w, c, mine, per_source))
    on_device = iter(to_device(to_copy, order.device))
    routes: list[ChunkRoute] = []
    send_begin = saved_begin = recv_begin = 0
    for w, c, mine, per_source in pieces:
        if routes and routes[-1].wave != w:
            recv_begin = 0  # a new wave reuses the receive buffer
        chunk_order = order[chunk_begin[c]:chunk_begin[c + 1]]
        if waves > 1:
            chunk_order = chunk_order[next(on_device)]
        expert_offsets = next(on_device)
        recv_to_expert = next(on_device) if setup.ep_size > 1 else None
        route = ChunkRoute(
            order=chunk_order,
            source_token=torch.div(chunk_order, setup.top_k, rounding_mode="floor"),
            send_splits=mine.sum(1).tolist(),
            recv_splits=per_source.sum(1).tolist(),
            expert_counts=per_source.sum(0).tolist(),
            expert_offsets=expert_offsets,
            recv_to_expert=recv_to_expert,
            expert_to_recv=None if recv_to_expert is None else inverse_permutation(recv_to_expert),
            send_begin=send_begin, recv_begin=recv_begin, wave=w, saved_begin=saved_begin,
        )
        routes.append(route)
        send_begin += route.send_rows
        recv_begin += route.recv_rows
        saved_begin += route.recv_rows
    return routes
