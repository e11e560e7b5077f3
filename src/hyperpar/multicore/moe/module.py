"""``MoeExperts``: the routed experts of an MoE layer, expert-parallel over an EP group."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from hyperpar.multicore.collective import CollectiveValueError, exchange, group_ranks, is_distributed
from hyperpar.multicore.module import MulticoreModule

from .config import DEFAULT_OVERLAP_CHUNKS, MoeExpertsConfig, describe_differences
from .function import ExpertMath, MoeCall, run_moe_experts
from .routing import GradNeeds, RoutingSetup, build_route_plan, is_integer_tensor
from .workspace import MoeWorkspace, WorkspaceSpec

log = logging.getLogger(__name__)


def _resolve_group(ep_size: int, ep_group: Any) -> tuple[Any, int]:
    """The EP process group and this rank's position in it. The group is None for the default
    group (a layer keeps no reference to it) and at ``ep_size=1`` (no communication at all)."""
    if (dist.is_available() and isinstance(ep_group, int) and not isinstance(ep_group, bool)
            and ep_group == dist.GroupMember.NON_GROUP_MEMBER):
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of ep_group: "
                         "torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here; "
                         "create MoeExperts only on the ranks of its EP group")
    if ep_group is not None and not (dist.is_available() and isinstance(ep_group, dist.ProcessGroup)):
        raise TypeError("ep_group must be None or a torch.distributed ProcessGroup, "
                        f"got {type(ep_group).__name__} {ep_group!r:.60}")
    if ep_size == 1:
        if ep_group is not None and is_distributed() and dist.get_world_size(ep_group) != 1:
            raise ValueError(f"ep_size=1 but ep_group has {dist.get_world_size(ep_group)} ranks")
        return None, 0
    if not is_distributed():
        raise ValueError(f"ep_size={ep_size} needs torch.distributed to be initialised "
                         "(or use ep_size=1)")
    group = None if ep_group is None or ep_group is dist.group.WORLD else ep_group
    size = dist.get_world_size(group)
    if size != ep_size:
        raise ValueError(f"ep_size={ep_size} but the EP group "
                         f"({'the default group' if group is None else 'ep_group'}) has {size} ranks")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of ep_group")
    return group, rank


def _grad_needs(hidden: torch.Tensor, topk_weights: Any, gate_up: Any, down: Any) -> GradNeeds:
    if not torch.is_grad_enabled():
        return GradNeeds()
    weights_grad = isinstance(topk_weights, torch.Tensor) and topk_weights.requires_grad
    experts_grad = gate_up.requires_grad or down.requires_grad
    return GradNeeds(recording=hidden.requires_grad or weights_grad or experts_grad,
                     hidden=hidden.requires_grad, expert_weights=experts_grad, route_weights=weights_grad)


class MoeExperts(MulticoreModule):
    """Routed SwiGLU experts; this rank holds experts ``[ep_rank * E_local, (ep_rank + 1) * E_local)``.

    ``forward(hidden_states [..., H], topk_ids [T, K], topk_weights [T, K])`` returns
    ``[..., H]`` with ``T`` = tokens in ``hidden_states`` (at most ``local_num_tokens``).
    Every rank of the EP group must call it the same number of times, in the same order.
    """

    def __init__(
        self, *, local_num_tokens: int, hidden_size: int, intermediate_size: int, num_experts: int,
        top_k: int, expert_capacity_factor: float | None = None, swiglu_limit: float | None = None,
        ep_size: int = 1, ep_group: Any = None, create_parameters: bool = True,
        overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS, gemm_dtype: torch.dtype | None = None,
    ) -> None:
        config = MoeExpertsConfig(
            local_num_tokens=local_num_tokens, hidden_size=hidden_size,
            intermediate_size=intermediate_size, num_experts=num_experts, top_k=top_k,
            expert_capacity_factor=expert_capacity_factor, swiglu_limit=swiglu_limit, ep_size=ep_size,
            create_parameters=create_parameters, overlap_chunks=overlap_chunks, gemm_dtype=gemm_dtype)
        group, ep_rank = _resolve_group(ep_size, ep_group)
        ranks = tuple(group_ranks(group)) if ep_size > 1 else (-1,)
        super().__init__(
            resource_specification=WorkspaceSpec(hidden_size=hidden_size, send_rows=config.send_rows,
                                                 capacity_rows=config.capacity_rows, ep_size=ep_size),
            resource_compatibility_key=("MoeExperts", ep_size, ranks),
            resource_scope_key=ranks)
        self.config = config
        self.ep_group = group
        self.ep_rank = ep_rank
        self._routing: RoutingSetup | None = RoutingSetup(
            num_experts=num_experts, top_k=top_k, max_tokens=local_num_tokens, ep_size=ep_size,
            ep_rank=ep_rank, group=group, chunks=overlap_chunks, capacity_rows=config.capacity_rows,
            capacity_description=config.capacity_description())
        self._math: ExpertMath | None = ExpertMath(swiglu_limit=config.swiglu_limit, ep_size=ep_size,
                                                   group=group, gemm_dtype=gemm_dtype)
        self._config_agreed = ep_size == 1
        if create_parameters:
            local = config.local_experts
            self.gate_up_weight = torch.nn.Parameter(torch.empty(local, hidden_size, 2 * intermediate_size))
            self.down_weight = torch.nn.Parameter(torch.empty(local, intermediate_size, hidden_size))
            self.reset_parameters()
        else:
            self.register_parameter("gate_up_weight", None)
            self.register_parameter("down_weight", None)

    # ----- parameters -----------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Xavier-uniform per expert matrix."""
        if self.gate_up_weight is None:
            return
        with torch.no_grad():
            for weight in (*self.gate_up_weight, *self.down_weight):
                torch.nn.init.xavier_uniform_(weight)

    @property
    def local_expert_ids(self) -> range:
        """The global ids of the experts whose weights live on this rank."""
        local = self.config.local_experts
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)

    # ----- lifecycle hooks ---------------------------------------------------------------
    def _create_execution_resources(self, tensor: torch.Tensor, *, shared: bool,
                                    active_specifications: Sequence[Any]) -> MoeWorkspace:
        spec = WorkspaceSpec.covering(active_specifications or (self.resource_specification,))
        workspace = MoeWorkspace(spec, tensor.device)
        log.debug("MoeExperts workspace for %d rows out, at most %d in, on %s (shared=%s)",
                  spec.send_rows, spec.capacity_rows, tensor.device, shared)
        return workspace

    def _resource_signature(self, tensor: torch.Tensor) -> Any:
        return (*self.config.signature(), tensor.device.type, str(tensor.dtype))

    def _root_group(self) -> Any:
        """Lifecycle collectives run over the EP group only; at ep_size=1 there are none."""
        if self.config.ep_size == 1:
            return None
        return self.ep_group if self.ep_group is not None else dist.group.WORLD

    def _forget_communication(self) -> None:
        if self.ep_group is not None:  # the default group is never referenced
            self.ep_group = None
            self._routing = self._math = None  # a copy of this closed layer cannot run: its group is gone

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the (possibly shared) workspace; 0 before the first call."""
        group = self._resource_group
        resources = None if group is None else group.resources
        return resources.nbytes if isinstance(resources, MoeWorkspace) else 0

    # ----- forward ----------------------------------------------------------------------
    def _agree_on_config(self) -> None:
        """Once per module: a differently configured rank would otherwise hang a later collective."""
        mine = self.config.signature_fields()
        everyone = exchange(mine, self.ep_group, stage="bind")
        if any(other != mine for other in everyone):
            # the collective kind (also a ValueError), the same on every rank: docs/multicore.md
            detail = describe_differences(dict(enumerate(everyone)))
            raise CollectiveValueError("bind", {},
                                       f"MoeExperts configuration differs across EP ranks: {detail}")
        self._config_agreed = True

    def _weights(self, expert_weights: Any, hidden: torch.Tensor | None,
                 problems: list[str]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The expert weights of this call; what is wrong with them goes to ``problems``."""
        cfg = self.config
        if cfg.create_parameters:
            if expert_weights is not None:
                problems.append("expert_weights must be None when create_parameters=True "
                                "(the module owns gate_up_weight and down_weight)")
            gate_up, down = self.gate_up_weight, self.down_weight
        elif (not isinstance(expert_weights, (tuple, list)) or len(expert_weights) != 2
                or not all(isinstance(w, torch.Tensor) for w in expert_weights)):
            problems.append("create_parameters=False needs expert_weights=(gate_up_weight, down_weight), "
                            f"got {type(expert_weights).__name__}")
            return None, None
        else:
            gate_up, down = expert_weights
        want = {"gate_up_weight": (gate_up, (cfg.local_experts, cfg.hidden_size, 2 * cfg.intermediate_size)),
                "down_weight": (down, (cfg.local_experts, cfg.intermediate_size, cfg.hidden_size))}
        for name, (weight, shape) in want.items():
            if tuple(weight.shape) != shape:
                problems.append(f"{name} must have shape {list(shape)}, got {list(weight.shape)}")
            if hidden is not None and (weight.dtype != hidden.dtype or weight.device != hidden.device):
                problems.append(f"{name} is {weight.dtype} on {weight.device} but hidden_states is "
                                f"{hidden.dtype} on {hidden.device}")
        return gate_up, down

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                tokens_per_expert: torch.Tensor | None = None,
                expert_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self._forward(hidden_states, topk_ids, topk_weights, tokens_per_expert=tokens_per_expert,
                             expert_weights=expert_weights)

    def _forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 tokens_per_expert: torch.Tensor | None,
                 expert_weights: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        # Every check is local and only collects problems: the route plan's exchange raises them on
        # every EP rank before anything binds or moves, so no rank is left in a collective and a
        # rejected call binds nothing.
        refusal = self._check_execution_input(hidden_states, "hidden_states")  # raises if closed
        if self._routing is None:
            raise RuntimeError("MoeExperts: this is a copy of a closed layer whose ep_group was released")
        if not self._config_agreed:
            # one-time lifecycle work, not part of a step: an OffloadSession tracing the step must
            # not record its collective
            with _disable_current_modes():
                self._agree_on_config()
        cfg = self.config
        problems: list[str] = [] if refusal is None else [str(refusal)]
        hidden_ok = isinstance(hidden_states, torch.Tensor)
        device = hidden_states.device if hidden_ok else torch.device("cpu")
        gate_up, down = self._weights(expert_weights, hidden_states if hidden_ok else None, problems)
        num_tokens = 0
        if hidden_ok and (hidden_states.dim() == 0 or hidden_states.shape[-1] != cfg.hidden_size):
            problems.append(f"hidden_states must end in hidden_size={cfg.hidden_size}, "
                            f"got shape {list(hidden_states.shape)}")
        elif hidden_ok:
            num_tokens = hidden_states.numel() // cfg.hidden_size
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.device != device:
            problems.append(f"topk_ids must be a tensor on {device} like hidden_states, got "
                            + (f"one on {topk_ids.device}" if isinstance(topk_ids, torch.Tensor)
                               else type(topk_ids).__name__))
            topk_ids = torch.zeros(num_tokens, cfg.top_k, dtype=torch.int64, device=device)
        if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
            problems.append(f"topk_weights must be a floating-point tensor, got {topk_weights!r:.80}")
        elif topk_weights.device != device:
            problems.append(f"topk_weights must be on {device} like hidden_states, got {topk_weights.device}")
        elif tuple(topk_weights.shape) != (num_tokens, cfg.top_k):
            problems.append(f"topk_weights must have shape [{num_tokens}, {cfg.top_k}], "
                            f"got {list(topk_weights.shape)}")
        if isinstance(tokens_per_expert, torch.Tensor) and not is_integer_tensor(tokens_per_expert):
            problems.append("tokens_per_expert must be an integer tensor (counts), "
                            f"got dtype={tokens_per_expert.dtype}")
            tokens_per_expert = None
        elif tokens_per_expert is not None and not isinstance(tokens_per_expert, torch.Tensor):
            problems.append("tokens_per_expert must be None or a tensor, "
                            f"got {type(tokens_per_expert).__name__}")
            tokens_per_expert = None
        elif tokens_per_expert is not None and tokens_per_expert.device != device:
            # caught here: a tensor on another device would send the layer's op elsewhere
            problems.append(f"topk_ids or tokens_per_expert cannot be read: tokens_per_expert is on "
                            f"{tokens_per_expert.device}, hidden_states on {device}")
            tokens_per_expert = None
        needs = GradNeeds() if problems else _grad_needs(hidden_states, topk_weights, gate_up, down)
        group = self._resource_group
        workspace: MoeWorkspace | None = None if group is None else group.resources
        if workspace is None:
            # The first call binds, collectively, once every rank's inputs are agreed on (the
            # plan's exchange raises every rank's problems everywhere); lifecycle work again.
            with _disable_current_modes():
                build_route_plan(self._routing, topk_ids, num_tokens, tokens_per_expert, problems, needs)
                workspace = self._get_execution_resources(hidden_states)
        call = MoeCall(self._routing, workspace, self._math, needs)
        out = run_moe_experts(hidden_states, num_tokens, topk_ids, topk_weights, gate_up, down,
                              tokens_per_expert, call, problems)
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={c.hidden_size}, intermediate_size={c.intermediate_size}, "
                f"num_experts={c.num_experts}, top_k={c.top_k}, ep_size={c.ep_size}, "
                f"local_experts={list(self.local_expert_ids)}, overlap_chunks={c.overlap_chunks}"
                + ("" if c.gemm_dtype is None else f", gemm_dtype={c.gemm_dtype}"))
