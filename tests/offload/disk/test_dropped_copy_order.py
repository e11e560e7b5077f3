"""A fast step's host copy that the disk tier drops for room while its copy back to the device is
still running: a later copy out of those device bytes must read them landed, never before."""

from __future__ import annotations

from pathlib import Path

import torch

from hyperpar.offload.capture.checked.replay_program import D2H, H2D, RELEASE
from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.fast.fast_schedule import MoveSchedule
from hyperpar.offload.runtime.chaos_copy_engine import ChaosCopyEngine
from hyperpar.offload.runtime.disk_tier import DiskTier
from hyperpar.offload.runtime.host_pool import HostPool

NBYTES = 16384


def test_a_copy_out_after_the_tier_drops_a_copy_in_flight_reads_the_landed_bytes(tmp_path: Path) -> None:
    # every copy completes only when waited on: the copy back is in flight until something waits
    # (a fast step where the copy back was never unpacked before the storage leaves again)
    engine = ChaosCopyEngine(seed=0, timing="never")
    pool = HostPool(8 * NBYTES, align=4096)
    tier = DiskTier(tmp_path, 8 * NBYTES, pool, finish=engine.finish, is_done=engine.is_done,
                    drop_copy=lambda entry: None)
    schedule = MoveSchedule(actions={}, moved_slots=frozenset({0}), slots=(0,), forward_end=1,
                            host_bytes=NBYTES, slot_sid={0: 7}, slot_bytes={0: NBYTES}, planned=(NBYTES,))
    moving = MovingStep(schedule, engine, pool, torch.device("cpu"), 1 << 20, tier=tier)
    try:
        saved = torch.arange(NBYTES // 4, dtype=torch.float32)
        packed = moving.pack(saved, 0, 0, saved.shape, saved.dtype, 0)
        s = moving.slots[0]
        del saved  # autograd's hold is the packed handle: the release lets the bytes go
        moving._run(((D2H, 0), (RELEASE, 0)), 0)  # out, and off the device
        moving._run(((H2D, 0),), 1)  # back: its copy in is still running
        assert s.h2d is not None and not engine.is_done(s.h2d)
        moving._drop_host_copy(s)  # the tier takes the room of a copy back on the device ...
        taken = pool.acquire_with_event(NBYTES)  # ... for another copy, which gets that slab
        assert taken is not None
        moving._run(((D2H, 0), (RELEASE, 0)), 2)  # out again: must read the bytes that landed
        engine.finish(s.d2h)  # the chaos engine raises here if the copy out read them early
        moving._run(((H2D, 0),), 3)
        engine.finish(s.h2d)
        back = moving.unpack(packed)
        assert torch.equal(back, torch.arange(NBYTES // 4, dtype=torch.float32))
    finally:
        tier.close()
