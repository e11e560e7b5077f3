"""Collective agreement helpers: every rank learns every rank's outcome before anyone goes on.

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

# Failure types that survive the exchange as a mix-in, so `except TypeError` keeps working
# on every rank when every failed rank raised that type.
_MIXABLE_TYPES: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}
_MIXED_CLASSES: dict[str, type[CollectiveError]] = {}


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


def exchange(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` in group-rank order; ``[value]`` without torch.distributed.

    The value is pickled before the collective, so one that cannot be pickled raises the same
    CollectiveError on every rank instead of failing on this rank alone (which would leave the
    peers waiting in ``all_gather_object``).
    """
    if not is_distributed():
        return [value]
    try:
        payload: tuple[bool, Any] = (True, pickle.dumps(value))
    except Exception as exc:
        payload = (False, (type(exc).__name__,
                           f"a {type(value).__name__} value cannot be exchanged (pickling failed: {exc})"))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    ranks = group_ranks(group)
    failures = {ranks[i]: item[1] for i, item in enumerate(gathered) if not item[0]}
    if failures:
        raise CollectiveError.create("exchange", failures)
    return [pickle.loads(item[1]) for item in gathered]


class CollectiveError(RuntimeError):
    """The same error, raised on every rank, when a stage failed on at least one rank.

    ``failures`` maps each failed global rank to ``(exception type name, message)``.
    """

    def __init__(self, stage: str, failures: dict[int, tuple[str, str]], detail: str = "") -> None:
        self.stage = stage
        self.failures = dict(failures)
        parts = [f"rank {rank}: {kind}: {message}" for rank, (kind, message) in sorted(failures.items())]
        text = f"stage {stage!r} failed on {len(failures)} rank(s): " + "; ".join(parts)
        if detail:
            text = f"stage {stage!r}: {detail}" if not failures else f"{text} ({detail})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_collective_error, (self.stage, self.failures, str(self)))

    @classmethod
    def create(cls, stage: str, failures: dict[int, tuple[str, str]], detail: str = "") -> CollectiveError:
        """The error for ``failures``, also an instance of TypeError/ValueError when every failed
        rank raised that type, so callers can catch the kind of mistake they made."""
        kinds = {kind for kind, _ in failures.values()}
        if len(kinds) == 1:
            kind = next(iter(kinds))
            base = _MIXABLE_TYPES.get(kind)
            if base is not None:
                mixed = _MIXED_CLASSES.get(kind)
                if mixed is None:
                    mixed = type(f"Collective{kind}", (CollectiveError, base), {"__module__": __name__})
                    _MIXED_CLASSES[kind] = mixed
                return mixed(stage, failures, detail)
        return cls(stage, failures, detail)


def _rebuild_collective_error(stage: str, failures: dict[int, tuple[str, str]], text: str) -> Exception:
    error = CollectiveError.create(stage, failures)
    error.args = (text,)
    return error


def outcome_of(exc: BaseException | None) -> tuple[str, str] | None:
    """The picklable description of a local failure that the other ranks will see."""
    if exc is None:
        return None
    return (type(exc).__name__, str(exc))


def raise_if_any_failed(
    stage: str, outcomes: Sequence[tuple[str, str] | None], ranks: Sequence[int],
    local_exc: BaseException | None = None,
) -> None:
    """Raise the same CollectiveError on every rank when any rank's outcome is a failure."""
    failures = {ranks[i]: outcome for i, outcome in enumerate(outcomes) if outcome is not None}
    if failures:
        raise CollectiveError.create(stage, failures) from local_exc


def collective_call(stage_name: str, fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn`` locally, then agree on the outcome: the result when every rank succeeded,
    otherwise the same CollectiveError (naming each failed rank and its error) on every rank.

    Only ``Exception`` is caught: an interrupt still stops this rank at once.
    """
    return agree_on(stage_name, fn, lambda value: exchange(value, group), group_ranks(group))


def agree_on(stage_name: str, fn: Callable[[], T], gather: Callable[[Any], list[Any]],
             ranks: list[int]) -> T:
    """``collective_call`` with the exchange given: ``gather(value)`` returns every rank's
    value in the order of ``ranks`` (a caller bound to a fixed group or to no group at all)."""
    result: Any = None
    local_exc: Exception | None = None
    try:
        result = fn()
    except Exception as exc:
        local_exc = exc
        logger.debug("stage %r failed locally: %s", stage_name, exc)
    raise_if_any_failed(stage_name, gather(outcome_of(local_exc)), ranks, local_exc)
    return result
