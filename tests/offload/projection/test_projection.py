"""The projection on a four-op trace, every figure computed by hand.

Device: 5e-3 TFLOP/s (a FLOP is 2e-4 µs), HBM 10 GB/s (a byte is 1e-4 µs), link 0.1 GB/s (a
byte is 1e-2 µs), no launch latency; host 5 µs per op.
  op0 mul  writes s0 (2000 B)                 0.2 µs  launch-bound
  op1 mm   s0 [10, 50] -> s1 [10, 100]        2*10*100*50 FLOP = 20 µs (bytes 2000 + 4000 + the
                                              weight 50*100*4 = 26000 B: 2.6 µs): compute-bound
  op2 mul  s1 -> s2 (4000 B)                  0.8 µs
  op3 add  s0, s2 -> s3 (2000 B)              0.8 µs
Plain: op0 5..5.2, op1 10..30, op2 30..30.8, op3 30.8..31.6.
With s0 out after op1 (D2H 30..50) and back before op3 (issued at 30.8, its D2H done at 50:
50..70): op3 waits 70 - 30.8 = 39.2 µs and ends at 70.8. The copy exceeds its window.
"""

from __future__ import annotations

import pytest

from hyperpar.offload.ir import (
    AccessKind,
    ActivationTrace,
    ResidencyAction,
    ResidencySchedule,
    StorageAccess,
    TraceOp,
)
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.ir.guide import OpGuide
from hyperpar.offload.projection import DeviceModel, HostCosts, get_device, op_costs, project
from hyperpar.offload.projection.timeline import device_times_us, run_timeline

R, W = AccessKind.READ, AccessKind.WRITE
DEVICE = DeviceModel("test", peak_tflops=5e-3, hbm_gbps=10.0, link_gbps=0.1, launch_us=0.0)
F32 = "torch.float32"


def _op(i: int, name: str, accesses: list[tuple[int, AccessKind]]) -> TraceOp:
    return TraceOp(name, 1.0, tuple(StorageAccess(i, sid, kind) for sid, kind in accesses))


def four_ops(with_guides: bool = True) -> ActivationTrace:
    ops = [_op(0, "aten.mul.Tensor", [(0, W)]),
           _op(1, "aten.mm.default", [(0, R), (1, W)]),
           _op(2, "aten.mul.Tensor", [(1, R), (2, W)]),
           _op(3, "aten.add.Tensor", [(0, R), (2, R), (3, W)])]
    guides = [OpGuide("aten.mul.Tensor", 1, {0: 0}, (((10, 50), F32),), (-1,)),
              OpGuide("aten.mm.default", 1, {0: 1}, (((10, 100), F32),), (0, -1)),
              OpGuide("aten.mul.Tensor", 1, {0: 2}, (((10, 100), F32),), (1,)),
              OpGuide("aten.add.Tensor", 1, {0: 3}, (((10, 50), F32),), (0, 2))]
    return ActivationTrace(ops, {0: 2000, 1: 4000, 2: 4000, 3: 2000}, retained_sids=frozenset({3}),
                           guides=guides if with_guides else [])


def offload_s0() -> ResidencySchedule:
    pre: list[list[ResidencyAction]] = [[], [], [], [ResidencyAction(Act.COPY_H2D, 0)]]
    post: list[list[ResidencyAction]] = [[], [ResidencyAction(Act.COPY_D2H, 0),
                                              ResidencyAction(Act.RELEASE_DEVICE, 0)], [], []]
    return ResidencySchedule(pre, post)


def test_flops_and_bytes_from_shapes() -> None:
    costs = op_costs(four_ops())
    assert costs.has_shapes and costs.flops_unknown == 0
    assert [c.flops for c in costs.ops] == [0, 100_000, 0, 0]
    assert [c.bytes for c in costs.ops] == [2000, 26_000, 8000, 8000]
    assert device_times_us(costs, DEVICE) == pytest.approx([0.2, 20.0, 0.8, 0.8])


def test_plain_step_launch_and_compute_bound() -> None:
    dev = device_times_us(op_costs(four_ops()), DEVICE)
    plain, _, _ = run_timeline(dev, 5.0, 0.0)
    assert plain.op_start_us == pytest.approx([5.0, 10.0, 30.0, 30.8])
    assert plain.step_us == pytest.approx(31.6)
    assert (plain.launch_bound_ops, plain.launch_bound_kernels) == (3, 3)  # all but the mm
    assert plain.copy_wait_us == 0.0


def test_launch_latency_delays_an_idle_device() -> None:
    dev = device_times_us(op_costs(four_ops()), DEVICE)
    late, _, _ = run_timeline(dev, 5.0, 4.0)
    assert late.op_start_us == pytest.approx([9.0, 14.0, 34.0, 34.8])


def test_a_copy_longer_than_its_window_makes_the_op_wait() -> None:
    trace = four_ops()
    dev = device_times_us(op_costs(trace), DEVICE)
    replay, d2h, h2d = run_timeline(dev, 5.0, 0.0, trace, offload_s0(), DEVICE.link_gbps)
    assert replay.copy_wait_us == pytest.approx(39.2)
    assert replay.op_start_us[3] == pytest.approx(70.0)
    assert replay.step_us == pytest.approx(70.8)
    assert (d2h, h2d) == (2000, 2000)


def test_without_shapes_bytes_only_and_said(caplog: pytest.LogCaptureFixture) -> None:
    costs = op_costs(four_ops(with_guides=False))
    assert not costs.has_shapes and costs.flops_unknown == 4
    assert [c.bytes for c in costs.ops] == [2000, 6000, 8000, 8000]
    assert "no shapes" in caplog.text


def test_project_at_full_budget_moves_nothing() -> None:
    trace = four_ops()
    proj = project(trace, DEVICE, HostCosts(plain_us=5.0, replay_us=5.0, warmup_us=30.0),
                   budget_bytes=trace.peak_bytes_without_offload())
    assert proj.plain.step_us == pytest.approx(31.6)
    assert proj.replay.step_us == pytest.approx(31.6) and proj.bytes_d2h == 0
    assert proj.warmup.step_us == pytest.approx(4 * 30.0 + 0.8)  # host-bound: the last op after it


@pytest.mark.parametrize(("call", "match"), [
    (lambda: get_device("tpu9"), r"device must be one of .*'tpu9'"),
    (lambda: HostCosts(plain_us=-1.0), r"plain_us must be .*-1\.0"),
    (lambda: DeviceModel("x", peak_tflops=0.0, hbm_gbps=1.0, link_gbps=1.0, launch_us=0.0),
     r"peak_tflops must be .* 0\.0"),
    (lambda: project(four_ops(), DEVICE, budget_bytes=-5), r"budget_bytes must be >= 0, got -5"),
])
def test_bad_inputs_name_the_argument_and_value(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
