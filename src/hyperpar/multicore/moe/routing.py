"""The route plan of one call: who sends which rows where, computed identically on every rank.

One small all-gather carries every rank's per-chunk expert counts and its input
problems, so validation failures and capacity overflows are raised with the same
error on every rank before any token moves, and no rank is left inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_OK = 0
_BAD_INPUT = 1


@dataclass(frozen=True)
class ChunkRoute:
    """Routing of one chunk of tokens (chunks overlap one's communication with another's compute)."""

    order: torch.Tensor  # [n] flattened (token, k) rows of the call, sorted by expert (stable)
    source_token: torch.Tensor  # [n] the token of each sorted row
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    expert_counts: list[int]  # rows per local expert after dispatch
    expert_offsets: torch.Tensor  # int32 end offsets of expert_counts, on the rows' device
    recv_to_expert: torch.Tensor | None  # received (source-major) row -> expert-major position
    send_begin: int  # first row of this chunk in the send-side workspace buffers
    recv_begin: int  # first row of this chunk in the receive-side workspace buffers

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


@dataclass(frozen=True)
class RoutePlan:
    num_tokens: int
    top_k: int
    chunks: tuple[ChunkRoute, ...]
    recv_rows: int  # rows this rank receives over all chunks
    max_recv_rows: int  # the largest receive count of any EP rank
    backward_dispatch: bool = False  # some EP rank needs expert-side gradients
    backward_combine: bool = False  # some EP rank needs the hidden-state gradient


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


def _input_problems(
    setup: RoutingSetup, topk_ids: torch.Tensor, num_tokens: int, tokens_per_expert: torch.Tensor | None,
) -> tuple[list[str], torch.Tensor | None, torch.Tensor | None]:
    """(problems, per-(chunk, expert) counts, per-row sort keys); no counts when there are problems."""
    problems: list[str] = []
    if not is_integer_tensor(topk_ids):
        problems.append(f"topk_ids must be an integer tensor, got dtype={topk_ids.dtype}")
        return problems, None, None
    if tuple(topk_ids.shape) != (num_tokens, setup.top_k):
        problems.append(f"topk_ids must have shape [{num_tokens}, {setup.top_k}] (tokens, top_k), "
                        f"got {list(topk_ids.shape)}")
        return problems, None, None
    if num_tokens > setup.max_tokens:
        problems.append(f"{num_tokens} tokens exceed local_num_tokens={setup.max_tokens}")
    if topk_ids.numel():
        low, high = (int(v) for v in topk_ids.aminmax())
        if low < 0 or high >= setup.num_experts:
            problems.append(f"topk_ids must lie in [0, {setup.num_experts}), got values in [{low}, {high}]")
    if problems:
        return problems, None, None
    chunk_of_row = _chunk_of_rows(num_tokens, setup.top_k, setup.chunks, topk_ids.device)
    keys = chunk_of_row * setup.num_experts + topk_ids.reshape(-1).to(torch.int64)
    counts = torch.bincount(keys, minlength=setup.chunks * setup.num_experts)
    if tokens_per_expert is not None:
        total = counts.view(setup.chunks, setup.num_experts).sum(0)
        given = tokens_per_expert.reshape(-1)
        if given.numel() != setup.num_experts or not torch.equal(given.to(total), total):
            problems.append(f"tokens_per_expert={given.tolist()} does not match the counts of "
                            f"topk_ids {total.tolist()}")
    return problems, counts, keys


def _chunk_bounds(num_tokens: int, chunks: int) -> list[int]:
    return [num_tokens * c // chunks for c in range(chunks + 1)]


def _chunk_of_rows(num_tokens: int, top_k: int, chunks: int, device: torch.device) -> torch.Tensor:
    bounds = _chunk_bounds(num_tokens, chunks)
    sizes = torch.tensor([(bounds[c + 1] - bounds[c]) * top_k for c in range(chunks)], device=device)
    return torch.repeat_interleave(torch.arange(chunks, device=device), sizes,
                                   output_size=num_tokens * top_k)


def _exchange_device(setup: RoutingSetup) -> torch.device:
    if setup.ep_size == 1 or str(dist.get_backend(setup.group)) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None, "a non-gloo backend without an accelerator"
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _exchange_header(setup: RoutingSetup, header: torch.Tensor) -> torch.Tensor:
    """All ranks' headers as [ep_size, len] on the CPU."""
    if setup.ep_size == 1:
        return header.cpu().unsqueeze(0)
    gloo_only = str(dist.get_backend(setup.group)) == "gloo"
    local = header.cpu() if gloo_only else header
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


def _recv_to_expert(per_source: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows received source-major ([source][expert]) into expert-major order."""
    sources, experts = per_source.shape
    lengths = per_source.reshape(-1)
    source_major_start = torch.cumsum(lengths, 0) - lengths
    expert_major_lengths = per_source.t().reshape(-1)
    expert_major_src = source_major_start.view(sources, experts).t().reshape(-1)
    expert_major_dst = torch.cumsum(expert_major_lengths, 0) - expert_major_lengths
    total = int(lengths.sum())
    shift = torch.repeat_interleave(expert_major_src - expert_major_dst, expert_major_lengths,
                                    output_size=total)
    return shift + torch.arange(total)


def build_route_plan(setup: RoutingSetup, topk_ids: torch.Tensor, num_tokens: int,
                     tokens_per_expert: torch.Tensor | None = None,
                     caller_problems: list[str] | None = None,
                     grad_needs: GradNeeds | None = None) -> RoutePlan:
    """Validate, exchange counts, check capacity (same error on every rank), derive splits.

    ``caller_problems`` are input errors the caller found (shapes, dtypes): they are
    raised on every EP rank instead of only here, so no rank hangs in the next collective.
    """
    try:
        problems, counts, keys = _input_problems(setup, topk_ids, num_tokens, tokens_per_expert)
    except Exception as exc:  # an input no check foresaw (sparse, meta): still rejected on every rank
        problems = [f"topk_ids or tokens_per_expert cannot be read: {type(exc).__name__}: {exc}"]
        counts = keys = None
    problems = list(caller_problems or []) + problems
    width = setup.chunks * setup.num_experts
    if problems:  # this rank's tensors may be anywhere (even on meta): its header goes where it can
        counts = torch.zeros(width, dtype=torch.int64, device=_exchange_device(setup))
    status = _BAD_INPUT if problems else _OK
    needs = grad_needs or GradNeeds()
    fixed = [status, num_tokens, int(needs.recording), int(needs.hidden), int(needs.expert_weights)]
    header = torch.cat([torch.tensor(fixed, dtype=torch.int64, device=counts.device), counts.to(torch.int64)])
    gathered = _exchange_header(setup, header)
    statuses = gathered[:, 0].tolist()
    if any(s != _OK for s in statuses):
        _raise_input_problems(setup, statuses, problems)
    recording = gathered[:, 2].tolist()
    if len(set(recording)) > 1:
        raise ValueError(
            "MoeExperts: autograd records this call on EP ranks "
            f"{[r for r, v in enumerate(recording) if v]} but not on "
            f"{[r for r, v in enumerate(recording) if not v]}; the backward is collective, so every "
            "EP rank must run the layer with the same grad mode and trainable inputs")
    backward_combine = bool(gathered[:, 3].any())
    backward_dispatch = backward_combine or bool(gathered[:, 4].any())

    local_experts = setup.local_experts
    counts_all = gathered[:, len(fixed):].view(setup.ep_size, setup.chunks, setup.ep_size, local_experts)
    recv_per_rank = counts_all.sum(dim=(0, 1, 3))  # [ep_size] rows each rank receives
    max_recv = int(recv_per_rank.max())
    if max_recv > setup.capacity_rows:
        worst = int(recv_per_rank.argmax())
        raise RuntimeError(
            f"MoeExperts expert capacity exceeded: EP rank {worst} needs {max_recv} rows but the "
            f"configured capacity is {setup.capacity_rows} rows ({setup.capacity_description}); "
            f"rows needed per EP rank: {recv_per_rank.tolist()}. Raise expert_capacity_factor "
            "or leave it None for lossless routing.")

    device = topk_ids.device
    me = setup.ep_rank
    assert keys is not None
    order = torch.argsort(keys, stable=True)  # by chunk, then expert; stable keeps token order
    chunk_routes: list[ChunkRoute] = []
    send_begin = 0
    recv_begin = 0
    for c in range(setup.chunks):
        mine = counts_all[me, c]  # [ep_size, local_experts]
        send_splits = mine.sum(1).tolist()
        per_source = counts_all[:, c, me]  # [ep_size sources, local_experts]
        recv_splits = per_source.sum(1).tolist()
        expert_counts = per_source.sum(0).tolist()
        chunk_rows = sum(send_splits)
        chunk_order = order[send_begin:send_begin + chunk_rows]
        recv_to_expert = None
        if setup.ep_size > 1:
            recv_to_expert = _recv_to_expert(per_source).to(device)
        chunk_routes.append(ChunkRoute(
            order=chunk_order,
            source_token=torch.div(chunk_order, setup.top_k, rounding_mode="floor"),
            send_splits=send_splits,
            recv_splits=recv_splits,
            expert_counts=expert_counts,
            expert_offsets=torch.tensor(expert_counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            .to(device),
            recv_to_expert=recv_to_expert,
            send_begin=send_begin,
            recv_begin=recv_begin,
        ))
        send_begin += chunk_rows
        recv_begin += sum(recv_splits)
    return RoutePlan(num_tokens=num_tokens, top_k=setup.top_k, chunks=tuple(chunk_routes),
                     recv_rows=recv_begin, max_recv_rows=max_recv,
                     backward_dispatch=backward_dispatch, backward_combine=backward_combine)
