"""The disk tier (issue 42) beside what else the session does: Hugging Face models, recompute,
``verify``, sessions on two threads, an interrupt mid-step, DDP ranks and a tmpfs directory.
Each case compares with the plain step bitwise, sees bytes really go to disk and come back, the
host budget held, and no file left once the session is closed."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.mode.dispatch_mode import current_offload_mode
from hyperpar.offload.runtime import disk_store
from hyperpar.offload.runtime.disk_tier import DiskTier
from hyperpar.offload.runtime.residency_manager import HostCopyCorruptedError, RestoreError
from tests.offload.disk.disk_rank_bodies import ddp_with_disk_tier_matches_plain
from tests.offload.disk.test_disk_tier_session import MIB, Loss, _files, _mlp_loss, _model, _run, _twin
from tests.offload.test_equality_models import _HFCausalLM
from tests.rank_harness import run_ranks


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons: plain PyTorch on 2 threads is not deterministic
    yield
    torch.set_num_threads(threads)


def _peak(build: Callable[[], nn.Module], loss_of: Loss, **config: Any) -> int:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6, **config))
    _run(build(), loss_of, 0, probe)
    assert probe.last_report is not None
    return probe.last_report.peak_resident_bytes


def _tiered(tmp: Path, peak: int, device: float = 0.5, host: float = 0.2, **config: Any) -> OffloadSession:
    return OffloadSession(OffloadConfig(max_resident_activation_mb=device * peak / MIB,
                                        max_host_activation_mb=host * peak / MIB, disk_dir=tmp, **config))


def _spilled(reports: Iterable[StepReport]) -> list[StepReport]:
    """Every report; fails unless some step wrote bytes to disk and read them back."""
    reports = list(reports)
    assert any(r.bytes_to_disk > 0 and r.bytes_from_disk > 0 for r in reports), \
        [(r.replay_path, r.bytes_to_disk, r.bytes_from_disk) for r in reports]
    return reports


# 1. Hugging Face families: a decoder (Llama) and an encoder-decoder (T5), random weights, offline

def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0))  # dropout 0.1: seeded per step
    return _HFCausalLM(model.train())


def _ids(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.randint(1, 128, (4, 24), generator=torch.Generator().manual_seed(step)))




@pytest.mark.usefixtures("steady_link")  # the plans take the fast path: the same path every run
@pytest.mark.parametrize(("kind", "host"), [("llama", 0.1), ("llama", 0.2), ("llama", 0.3), ("t5", 0.2)])
def test_hugging_face_models_are_bitwise_through_the_disk_tier(
        tmp_path: Path, kind: str, host: float, caplog: pytest.LogCaptureFixture) -> None:
    """At small host budgets (Llama at 10-20 % of its peak, a few of its copies) the copies the
    tier can neither write out nor drop (copied out, not yet released) can hold the whole budget
    when a copy on disk must come back: it is read past the budget, and that is said."""
    caplog.set_level(logging.WARNING, logger="hyperpar.offload.runtime.disk_tier")
    session = _tiered(tmp_path, _peak(lambda: _hf(kind), _ids), device=0.5, host=host)
    budget = session.config.host_budget_bytes or 0
    reports = _spilled(_twin(_hf(kind), _hf(kind), session, _ids, range(5), host_held=False))
    if any(r.peak_host_bytes > budget for r in reports):
        assert any("read past the budget" in r.getMessage() for r in caplog.records), \
            "the host budget was passed and nothing said so"
    session.close()
    assert _files(tmp_path) == []


_LENGTHS = [24] * 4 + [32] + [16, 24, 32, 20, 32, 28, 12, 32]


def _ids_of_length(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.randint(1, 128, (4, _LENGTHS[step]), generator=torch.Generator().manual_seed(step)))


@pytest.mark.usefixtures("steady_link")  # which steps go fast: the same every run
def test_lengths_that_vary_go_through_the_disk_tier_bitwise_and_fast(tmp_path: Path) -> None:
    """A longer length falls back once; from then on each step hands off to the fast path at
    its first saved tensor where a plan covers it (the tier's order of copies becomes that
    plan's), or stays checked: bitwise, through the disk, no file left."""
    session = _tiered(tmp_path, _peak(lambda: _hf("llama"), _ids_of_length), device=0.5, host=0.3)
    reports = _spilled(_twin(_hf("llama"), _hf("llama"), session, _ids_of_length, range(len(_LENGTHS)),
                             host_held=False))
    paths = [r.replay_path for r in reports]
    assert paths[4] == "fallback" and paths.count("fallback") == 1, paths
    handed = [r for r in reports[5:] if r.replay_path == "fast"]  # each began checked
    assert handed and any(r.bytes_to_disk > 0 and r.bytes_from_disk > 0 for r in handed), \
        [(r.replay_path, r.bytes_to_disk, r.bytes_from_disk) for r in reports]
    # (which later steps go fast follows the plans the tier's timing shapes; test_fast_lengths
    # pins the sequence on the sync engine)
    assert all(r.checked_prefix_ops == handed[0].checked_prefix_ops for r in handed), handed
    session.close()
    assert _files(tmp_path) == []


# 2. recompute="layers": rebuilt blocks beside copies through the tier

@pytest.mark.usefixtures("steady_link")  # the rebuilt plan's fast steps move bytes through the tier
def test_recompute_layers_beside_the_disk_tier_is_bitwise(tmp_path: Path) -> None:
    """Host 0.1 of the peak: the rebuilt plan's host copies exceed it, so copies go to disk
    beside the rebuilt layers (at 0.2 they fit it, and nothing is written)."""
    from tests.offload.test_recompute import Net

    rows = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        return model(rows)

    session = _tiered(tmp_path, _peak(lambda: Net(64), loss_of, recompute="off"), device=0.3, host=0.1,
                      recompute="layers")
    reports = _spilled(_twin(Net(64), Net(64), session, loss_of, range(6)))
    assert any(r.bytes_recomputed > 0 and r.bytes_to_disk > 0 for r in reports), "not both at once"
    session.close()
    assert _files(tmp_path) == []


# 3. verify=True on the fast path through the tier

@pytest.mark.usefixtures("steady_link")  # asserts the fast path runs (tests/offload/conftest.py)
@pytest.mark.usefixtures("steady_link")
def test_verify_keeps_every_step_checked_and_bitwise_through_the_disk_tier(tmp_path: Path) -> None:
    """The fast path takes no checksums of its host copies: with ``verify=True`` the session
    stays on the checked replay, which checks every copy that comes back, disk ones too."""
    peak = _peak(_model, _mlp_loss)
    session = _tiered(tmp_path, peak, device=0.6, verify=True)
    reports = _spilled(_twin(_model(), _model(), session, _mlp_loss, range(5)))
    assert "fast" not in [r.replay_path for r in reports]
    assert any(r.replay_path == "checked" and r.bytes_from_disk > 0 for r in reports), \
        "no checked step used disk"
    session.close()
    assert _files(tmp_path) == []


@pytest.mark.usefixtures("steady_link")
def test_verify_catches_corrupted_disk_bytes_on_a_planned_step(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the plan would run fast without ``verify``, a bit flipped on disk is caught."""
    session = _tiered(tmp_path, _peak(_model, _mlp_loss), device=0.6, verify=True)
    plain, off = _model(), _model()
    paths = [r.replay_path for r in _twin(plain, off, session, _mlp_loss, range(4))]
    assert paths[-1] == "checked", paths
    real_read = disk_store.DiskStore.read
    flipped = {"n": 0}

    def flipping_read(self: disk_store.DiskStore, extent: disk_store.Extent, dst: torch.Tensor) -> None:
        real_read(self, extent, dst)
        dst[0] ^= 1  # one bit, as a bad disk would
        flipped["n"] += 1

    monkeypatch.setattr(disk_store.DiskStore, "read", flipping_read)
    try:
        with pytest.raises((HostCopyCorruptedError, RestoreError), match="checksum"):
            list(_twin(plain, off, session, _mlp_loss, [4]))
    finally:
        if not flipped["n"]:
            pytest.fail("nothing was read back from disk: the test tested nothing")
    assert _files(tmp_path) == []
    session.close()


# 4. two sessions on two threads sharing one directory

def test_two_sessions_on_two_threads_share_one_directory(tmp_path: Path) -> None:
    peak = _peak(_model, _mlp_loss)
    sessions = [_tiered(tmp_path, peak, device=0.6, host=0.1) for _ in range(2)]
    twins = [(_model(), _model()) for _ in sessions]  # here: the global RNG seeds them, one thread at a time
    both_open = threading.Barrier(2, timeout=60)
    seen: list[list[str]] = []
    problems: list[BaseException] = []

    def work(session: OffloadSession, plain: nn.Module, off: nn.Module) -> None:
        try:
            _spilled(_twin(plain, off, session, _mlp_loss, range(3)))
            both_open.wait()  # both sessions hold their files now
            seen.append(sorted(_files(tmp_path)))
            both_open.wait()
            _spilled(_twin(plain, off, session, _mlp_loss, range(3, 6)))
            session.close()
        except BaseException as exc:  # reported by the main thread
            both_open.abort()
            problems.append(exc)

    threads = [threading.Thread(target=work, args=(session, *twin))
               for session, twin in zip(sessions, twins, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if problems:
        raise problems[0]
    assert len(seen) == 2 and len(seen[0]) == 2 and seen[0] == seen[1], seen
    assert _files(tmp_path) == []


# 5. a KeyboardInterrupt from a forward hook, with bytes on disk

@pytest.mark.usefixtures("steady_link")  # the interrupted step is a fast one (no fallback)
def test_an_interrupt_mid_forward_leaves_no_file_and_the_session_runs_on(tmp_path: Path) -> None:
    session = _tiered(tmp_path, _peak(_model, _mlp_loss), device=0.6, host=0.2)
    plain, off = _model(), _model()
    _spilled(_twin(plain, off, session, _mlp_loss, range(4)))
    seen: dict[str, Any] = {}

    def interrupt(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen.update(disk=session._manager.bytes_to_disk, fast=session._fast is not None,
                    fallback=session._executor is not None)
        raise KeyboardInterrupt

    handle = off[3].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        _run(off, _mlp_loss, 4, session)
    handle.remove()
    assert seen == {"disk": seen["disk"], "fast": True, "fallback": False}, seen
    assert seen["disk"] > 0, "no bytes were on disk when the interrupt came: it tests nothing"
    assert _files(tmp_path) == [], "an interrupted step unlinks the store's file"
    assert current_offload_mode() is None
    assert all(p.grad is None for p in off.parameters()), "an interrupted forward left gradients"
    _spilled(_twin(plain, off, session, _mlp_loss, range(5, 9)))
    session.close()
    assert _files(tmp_path) == []


@pytest.mark.usefixtures("steady_link")
@pytest.mark.parametrize("fallback", [False, True])
def test_a_fast_step_whose_end_fails_leaves_no_mode_and_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool) -> None:
    """``MovingStep.finish`` (the fast step's end: page-ins for handles still held, slabs back)
    raising: the step fails with its error, the dispatch mode of a fallback is left, the file
    unlinked, and the next step of the session runs bitwise. (``fallback``: the fast step's
    copies find no host room, as when copies in flight hold it all, and it falls back; a plan
    whose checked replay found none does not go fast at all.)"""
    session = _tiered(tmp_path, _peak(_model, _mlp_loss), device=0.6, host=0.2)
    plain, off = _model(), _model()
    list(_twin(plain, off, session, _mlp_loss, range(2)))  # the plan; step 2 replays it fast
    if fallback:  # the third copy out finds no room: the step goes on under the dispatch mode
        real_acquire, calls = DiskTier.acquire, [0]

        def once_short(self: DiskTier, nbytes: int) -> Any:
            calls[0] += 1
            return None if calls[0] == 3 else real_acquire(self, nbytes)

        monkeypatch.setattr(DiskTier, "acquire", once_short)
    real_finish = MovingStep.finish
    seen: list[bool] = []

    def failing_finish(self: MovingStep) -> None:
        real_finish(self)
        seen.append(session._executor is not None and session._manager.bytes_to_disk > 0)
        raise RuntimeError("finish failed (test)")

    monkeypatch.setattr(MovingStep, "finish", failing_finish)
    with pytest.raises(RuntimeError, match="finish failed"):
        _run(off, _mlp_loss, 2, session)
    monkeypatch.undo()
    assert seen == [fallback], seen  # the step fell back (no host room) or not
    assert current_offload_mode() is None, "the fallback's dispatch mode was left entered"
    assert _files(tmp_path) == [], "a failed fast step unlinks the store's file"
    for p in off.parameters():
        p.grad = None
    _spilled(_twin(plain, off, session, _mlp_loss, range(3, 6)))
    session.close()


# 6. DDP on two gloo ranks

@pytest.mark.timeout(90)
@pytest.mark.parametrize("shared", [True, False], ids=["one_dir", "dir_per_rank"])
def test_ddp_ranks_through_the_disk_tier_are_bitwise(tmp_path: Path, shared: bool) -> None:
    dirs = [tmp_path if shared else tmp_path / f"rank{r}" for r in range(2)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    results = run_ranks(ddp_with_disk_tier_matches_plain, 2, args=(str(tmp_path), shared, 5), timeout=75)
    for rank, out in results.items():
        assert all(out["equal"]), (rank, out["equal"])
        assert any(b > 0 for b in out["to_disk"]), (rank, out["to_disk"])
        assert out["mine"] in out["open"] and out["left"] == [], (rank, out)
    assert results[0]["mine"] != results[1]["mine"] or not shared
    for d in dirs:
        assert _files(d) == [], d


# 7. a tmpfs directory: O_DIRECT where the kernel has it, else buffered with one warning

def test_a_tmpfs_directory_works_bitwise(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    shm = Path("/dev/shm")
    mounts = Path("/proc/mounts").read_text().split("\n") if Path("/proc/mounts").exists() else []
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts if line.strip()):
        pytest.skip("no tmpfs at /dev/shm")
    monkeypatch.setattr(disk_store, "_fallback_warned", False)  # the one warning per process: this test's
    with tempfile.TemporaryDirectory(dir=shm, prefix="hyperpar-test-") as where:
        directory = Path(where)
        session = _tiered(directory, _peak(_model, _mlp_loss), device=0.6, host=0.1)
        with caplog.at_level(logging.WARNING, logger=disk_store.__name__):
            reports = list(_twin(_model(), _model(), session, _mlp_loss, range(2)))
            store = session._manager.tier.store if session._manager.tier is not None else None
            assert store is not None, "the tier opened no store"
            direct = store.direct
            reports += _twin(_model(), _model(), session, _mlp_loss, range(2, 4))
        _spilled(reports)
        said = [r.getMessage() for r in caplog.records if r.name == disk_store.__name__]
        assert len(said) == (0 if direct else 1), (direct, said)
        assert direct or where in said[0]
        session.close()
        assert _files(directory) == []
