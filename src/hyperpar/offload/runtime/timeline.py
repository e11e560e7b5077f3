"""The last replay's timeline as a Chrome trace (chrome://tracing, Perfetto).

Tracks in one process: compute (one slice per op), D2H and H2D (one slice per copy, named
after the storage) and, with a disk tier, its writes and reads (host clock, from the tier's
``begin_step``). Times are microseconds from the start of the step. The step's
totals (``step``: what it kept on the device, offloaded, rebuilt in backward) go in
``otherData`` and on a marker at its start, since a rebuilt call shows only as more ops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperpar.offload.runtime.copy_engine import D2H_LANE, DISK_READ_LANE, DISK_WRITE_LANE, H2D_LANE, CopySpan

COMPUTE_TRACK = "compute"
TRACKS = {COMPUTE_TRACK: 1, D2H_LANE: 2, H2D_LANE: 3, DISK_WRITE_LANE: 4, DISK_READ_LANE: 5}


@dataclass
class StepTimeline:
    ops: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start ms, end ms)
    copies: list[CopySpan] = field(default_factory=list)
    waits: list[tuple[int, float]] = field(default_factory=list)  # (op index, ms the op waited)
    clock: str = "host"  # what the op times measure: "host" (perf_counter) or "device" (events)
    # the step's report totals (bytes_d2h, bytes_h2d, bytes_recomputed, ...); empty: none known
    step: dict[str, int] = field(default_factory=dict)

    def chrome_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "hyperpar offload step"}}
        ]
        lanes = {c.lane for c in self.copies}
        for name, tid in TRACKS.items():
            if name in (DISK_WRITE_LANE, DISK_READ_LANE) and name not in lanes:
                continue  # disk tracks only where a disk tier moved bytes
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                           "args": {"sort_index": tid}})
        wait_of = dict(self.waits)
        for i, (name, start, end) in enumerate(self.ops):
            args: dict[str, Any] = {"op": i}
            if i in wait_of:
                args["wait_ms"] = wait_of[i]
            events.append({"name": name, "cat": "op", "ph": "X", "pid": 1, "tid": TRACKS[COMPUTE_TRACK],
                           "ts": start * 1e3, "dur": max(end - start, 0.0) * 1e3, "args": args})
        if self.step:  # a process-wide marker at the step's start, its totals in the args
            events.append({"name": "step", "cat": "step", "ph": "i", "s": "p", "pid": 1,
                           "tid": TRACKS[COMPUTE_TRACK], "ts": 0.0, "args": dict(self.step)})
        for c in self.copies:
            events.append({"name": f"storage {c.label}", "cat": c.lane, "ph": "X", "pid": 1,
                           "tid": TRACKS[c.lane], "ts": c.start_ms * 1e3,
                           "dur": max(c.end_ms - c.start_ms, 0.0) * 1e3,
                           "args": {"storage": c.label, "bytes": c.nbytes}})
        return events

    def write_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"traceEvents": self.chrome_events(), "displayTimeUnit": "ms",
               "otherData": {"op_clock": self.clock, "step": dict(self.step)}}
        path.write_text(json.dumps(doc))
        return path
