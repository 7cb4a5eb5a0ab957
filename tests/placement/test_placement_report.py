"""placement_report: layers, parameters and optimizer state per device,
read from where TensorFlow put the variables; printed and returned."""

from __future__ import annotations

from _placement_helpers import CPUS, stage_cuts, staged_mlp

from keras_mgpu import _flavour, placement_report
from keras_mgpu.placement import apply_placement

keras = _flavour.keras


def test_rows_per_device_before_and_after_training():
    model = staged_mlp(3)
    placed = apply_placement(
        model, CPUS[1:4], policy=stage_cuts(model), micro_batches=2
    )
    lines = []
    rows = placement_report(placed, print_fn=lines.append)
    assert [r["device"] for r in rows] == [
        "/device:CPU:1",
        "/device:CPU:2",
        "/device:CPU:3",
    ]
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert rows[0]["layers"] == ["s0_a", "s0_b"]
    assert rows[2]["layers"] == ["s2_a", "s2_b", "s2_out"]
    assert sum(r["params"] for r in rows) == model.count_params()
    assert rows[1]["param_bytes"] == 4 * sum(
        model.get_layer(n).count_params() for n in ("s1_a", "s1_b")
    )
    assert all(r["optimizer_bytes"] is None for r in rows)  # not built yet
    assert all(r["peak_bytes"] is None for r in rows)  # CPU: one allocator
    table = lines[0]
    assert "3 stage(s), 2 micro-batches per step" in table
    assert "CPU:2" in table and "s1_a, s1_b" in table
    assert "one allocator for all logical CPU devices" in table

    placed.compile(optimizer="adam", loss="mse")
    placed.optimizer.build(placed.trainable_variables)
    rows = placement_report(placed, print_fn=None)
    # Adam: two slots per weight, on the weight's device; the step counter
    # and learning rate stay on the host (cpu:0), a row without a stage.
    for row in rows[:3]:
        assert row["optimizer_bytes"] == 2 * row["param_bytes"]
    assert rows[3]["device"] == "/device:CPU:0" and rows[3]["stage"] is None
    assert rows[3]["params"] == 0 and rows[3]["optimizer_bytes"] > 0


def test_an_unplaced_model_reports_one_device():
    model = staged_mlp(2)
    lines = []
    rows = placement_report(model, print_fn=lines.append)
    assert len(rows) == 1 and rows[0]["params"] == model.count_params()
    assert "1 stage(s), no pipelining" in lines[0]
    assert "s0_a ... s1_out (5 layers)" in lines[0]
