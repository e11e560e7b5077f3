import pickle

import pytest

from hyperpar.multicore.collective import CollectiveError, collective_call, exchange, group_ranks


def test_exchange_without_distributed_returns_the_value_alone() -> None:
    value = {"a": 1}
    assert exchange(value) == [value]
    assert group_ranks() == [0]


def test_collective_call_returns_the_local_result() -> None:
    assert collective_call("stage", lambda: 42) == 42


def test_collective_call_failure_names_rank_type_and_message() -> None:
    def boom() -> None:
        raise KeyError("missing thing")

    pattern = r"stage 'load' failed on 1 rank\(s\): rank 0: KeyError"
    with pytest.raises(CollectiveError, match=pattern) as info:
        collective_call("load", boom)
    assert info.value.failures == {0: ("KeyError", "'missing thing'")}
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("kind", [TypeError, ValueError])
def test_error_is_also_the_failed_type_when_every_failure_agrees(kind: type[Exception]) -> None:
    error = CollectiveError.create("s", {0: (kind.__name__, "x"), 2: (kind.__name__, "y")})
    assert isinstance(error, kind) and isinstance(error, CollectiveError) and isinstance(error, RuntimeError)
    assert "rank 0: " in str(error) and "rank 2: " in str(error)


def test_mixed_failure_types_give_a_plain_collective_error() -> None:
    error = CollectiveError.create("s", {0: ("TypeError", "x"), 1: ("ValueError", "y")})
    assert type(error) is CollectiveError


def test_collective_error_pickles_with_its_type_and_text() -> None:
    error = CollectiveError.create("s", {1: ("TypeError", "bad")})
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, TypeError) and str(back) == str(error) and back.failures == error.failures
