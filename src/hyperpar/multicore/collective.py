"""Collective agreement: every rank learns every rank's outcome before anyone goes on.

A rank that raises on its own while its peers enter the next collective leaves them hanging
until the backend timeout. Everything that allocates or frees execution resources therefore
runs its local work first and then exchanges the outcome, so that all ranks raise together.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_distributed() -> bool:
    """True when collectives are possible: torch.distributed built in and initialised."""
    return dist.is_available() and dist.is_initialized()


def group_ranks(group: Any = None) -> list[int]:
    """Global ranks of the group's members in group-rank order (``[0]`` when not distributed)."""
    if not is_distributed():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def exchange(value: Any, group: Any = None, *, stage: str = "exchange") -> list[Any]:
    """Every rank's ``value`` in group-rank order; ``[value]`` without torch.distributed.

    The value is pickled before the collective, so one that cannot be pickled raises the same
    CollectiveError on every rank instead of failing on this rank alone. A failure of the
    collective itself (a peer died, the timeout expired) is raised as a CollectiveError naming
    ``stage``, chained to the backend's error.
    """
    if not is_distributed():
        return [value]
    try:
        payload: tuple[bool, Any] = (True, pickle.dumps(value))
    except Exception as exc:
        payload = (False, (type(exc).__name__,
                           f"a {type(value).__name__} value cannot be exchanged (pickling failed: {exc})"))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, payload, group=group)
    except RuntimeError as exc:  # the backend's errors (DistBackendError, timeouts) are RuntimeErrors
        raise CollectiveError(stage, {}, "the exchange with the other ranks failed on this rank (a peer "
                                         f"died, left or timed out): {type(exc).__name__}: {exc}") from exc
    ranks = group_ranks(group)
    failures = {ranks[i]: item[1] for i, item in enumerate(gathered) if not item[0]}
    if failures:
        raise CollectiveError.create(stage, failures)
    return [pickle.loads(item[1]) for item in gathered]


class CollectiveError(RuntimeError):
    """The same error, raised on every rank, when a stage failed on at least one rank.

    ``failures`` maps each failed global rank to ``(exception type name, message)``.
    """

    def __init__(self, stage: str, failures: dict[int, tuple[str, str]], detail: str = "") -> None:
        self.stage = stage
        self.failures = dict(failures)
        self.detail = detail
        parts = [f"rank {rank}: {kind}: {message}" for rank, (kind, message) in sorted(failures.items())]
        text = f"stage {stage!r} failed on {len(failures)} rank(s): " + "; ".join(parts)
        if detail:
            text = f"stage {stage!r}: {detail}" if not failures else f"{text} ({detail})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage, self.failures, self.detail))

    @staticmethod
    def create(stage: str, failures: dict[int, tuple[str, str]], detail: str = "") -> CollectiveError:
        """The error for ``failures``; also a TypeError or ValueError when every failed rank raised
        that type, so that callers can catch the kind of mistake they made."""
        kinds = {kind for kind, _ in failures.values()}
        kind = _KINDS.get(next(iter(kinds))) if len(kinds) == 1 else None
        return (kind or CollectiveError)(stage, failures, detail)


class CollectiveTypeError(CollectiveError, TypeError):
    """A CollectiveError whose every failed rank raised TypeError."""


class CollectiveValueError(CollectiveError, ValueError):
    """A CollectiveError whose every failed rank raised ValueError."""


_KINDS: dict[str, type[CollectiveError]] = {"TypeError": CollectiveTypeError,
                                            "ValueError": CollectiveValueError}


def outcome_of(exc: BaseException | None) -> tuple[str, str] | None:
    """The picklable description of a local failure that the other ranks will see."""
    return None if exc is None else (type(exc).__name__, str(exc))


def raise_if_any_failed(stage: str, outcomes: Sequence[tuple[str, str] | None], ranks: Sequence[int],
                        local_exc: BaseException | None = None) -> None:
    """Raise the same CollectiveError on every rank when any rank's outcome is a failure."""
    failures = {ranks[i]: outcome for i, outcome in enumerate(outcomes) if outcome is not None}
    if failures:
        raise CollectiveError.create(stage, failures) from local_exc


def _registered(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True


class Scope:
    """Where lifecycle collectives run: over one root process group, or nowhere.

    A ``None`` root, or none at all because torch.distributed is not initialised, keeps every
    step on this rank. So does a root that has been destroyed since: whatever is left of it is
    then released locally, which is all a rank can do without its peers.
    """

    __slots__ = ("key", "root")

    def __init__(self, root: Any) -> None:
        self.root = root if root is not None and is_distributed() else None
        # binding ids count per key; a group name, not the group, so that no counter keeps it alive
        self.key: str | None = None if self.root is None else str(self.root.group_name)

    def local(self) -> bool:
        return self.root is None or not is_distributed() or not _registered(self.root)

    def ranks(self) -> list[int]:
        if self.local():
            return [dist.get_rank() if is_distributed() else 0]
        return group_ranks(self.root)

    def gather(self, stage: str, value: Any) -> list[Any]:
        if self.root is None:
            return [value]
        if self.local():
            logger.warning("%s: process group %s is no longer initialised; running on this rank alone",
                           stage, self.key)
            return [value]
        return exchange(value, self.root, stage=stage)

    def agree(self, stage: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` here, then raise the same CollectiveError on every rank if any rank failed.
        Only ``Exception`` is caught: an interrupt still stops this rank at once."""
        result: Any = None
        local_exc: Exception | None = None
        try:
            result = fn()
        except Exception as exc:
            local_exc = exc
            logger.debug("stage %r failed locally: %s", stage, exc)
        raise_if_any_failed(stage, self.gather(stage, outcome_of(local_exc)), self.ranks(), local_exc)
        return result


def collective_call(stage_name: str, fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn`` locally, then agree on the outcome: the result when every rank of ``group``
    (default: the world) succeeded, otherwise the same CollectiveError (naming each failed rank
    and its error) on every rank."""
    return Scope(group if group is not None else dist.group.WORLD if is_distributed() else None).agree(
        stage_name, fn)
