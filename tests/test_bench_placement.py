"""The placement predictor: its calibration from the committed one-GPU results (multi-GPU jobs left out), the
per-phase model, the validation against the committed multi-GPU jobs, and the command line."""

from __future__ import annotations

import json

import pytest

from colocated_grpo.bench.placement import calibration, validation
from colocated_grpo.bench.placement.__main__ import main
from colocated_grpo.bench.placement.model import Placement, Workload, placements, predict
from colocated_grpo.provenance import REPO

RESULTS = REPO / "sweeps" / "results"
CALIBRATION = RESULTS / "placement_model" / "calibration_h200.json"
ONE_GPU = [RESULTS / "fast_outputs_h200", RESULTS / "fast_sync_h200", RESULTS / "h200_x2"]
MULTI_GPU = [
    RESULTS / "h200_x2",
    RESULTS / "tp_x_gpu_mem_1.5b" / "tp1_tp2_first_run",
    RESULTS / "tp_x_gpu_mem_1.5b" / "tp2_mem0.5_0.7",
]


@pytest.fixture(scope="module")
def built():
    return calibration.build(ONE_GPU)


def test_the_committed_calibration_is_what_calibrate_builds_from_one_gpu_runs_only(built):
    assert json.loads(json.dumps(built)) == json.loads(CALIBRATION.read_text())
    assert all("h200_x2" not in s for s in built["sources"]), "no multi-GPU job calibrates the model"
    assert len([x for x in built["left_out"] if "(2 GPUs)" in x]) == 12
    m = built["models"]["qwen2.5-1.5b"]
    assert [b for b, _ in m["generate"]["fast"]] == [32, 64, 128, 256]
    assert m["sync_s"]["trl"] > 5 * m["sync_s"]["fast"] and m["sleep_wake_s"] > 0
    assert 1e-5 < m["train"]["s_per_token"] < 1e-4


def test_phases_follow_the_placement(built):
    work = Workload(256, 61, 256, 1.544)
    one, eight = predict(built, work, Placement("colocate", 1)), predict(built, work, Placement("colocate", 8))
    assert eight.phases["train"] < one.phases["train"] / 4 and eight.phases["generate"] < one.phases["generate"]
    assert eight.step_s == pytest.approx(sum(eight.phases.values()))
    sleep = predict(built, work, Placement("colocate_sleep", 8))
    assert sleep.phases["sleep_wake"] > 0 == eight.phases["sleep_wake"]
    server = predict(built, work, Placement("server", 8, server_gpus=1, request="trl"))
    assert server.phases["train"] > eight.phases["train"], "7 training GPUs, not 8"
    assert [p.name for p in placements(3)] == [
        "colocate 3 (fast)",
        "colocate + sleep 3 (fast)",
        "server 2+1",
        "server 1+2",
    ]
    longer = predict(built, Workload(256, 61, 1024, 1.544), Placement("colocate", 8))
    assert longer.phases["generate"] > 4 * eight.phases["generate"], "4× the tokens and a longer context"


def test_an_uncalibrated_size_is_flagged_and_a_batch_past_the_curve_too(built):
    big = predict(built, Workload(1024, 150, 1024, 7.6), Placement("server", 8, server_gpus=1, request="trl"))
    assert any("extrapolated from" in f for f in big.flags) and any("past the calibrated" in f for f in big.flags)
    assert all(v >= 0 for v in big.phases.values())


def test_validation_against_every_committed_multi_gpu_job(built):
    table = validation.rows(built, MULTI_GPU)
    modelled = [r for r in table if "error" in r]
    assert len(table) == 18 and len(modelled) == 11 and not any(r["in_sample"] for r in table)
    assert {r["note"].split(":")[0] for r in table if "error" not in r} == {"not modelled"}
    s = validation.summary(table)
    assert s["median"] <= 0.10, s  # the goal; the max is reported in docs/placement.md, not asserted
    committed = (RESULTS / "placement_model" / "validation.md").read_text()
    everything = validation.rows(built, [*MULTI_GPU, RESULTS / "fast_outputs_h200", RESULTS / "fast_sync_h200"])
    assert validation.markdown(everything) in committed, "validation.md is what `validate` makes of the kept runs"
    assert "out of sample (multi-GPU): 11 jobs" in committed


def test_predict_prints_a_ranked_table_and_writes_a_figure(tmp_path, capsys):
    figure = tmp_path / "rank.png"
    main(
        [
            "predict",
            f"--calibration={CALIBRATION}",
            "--gpus=4",
            "--completions=256",
            "--prompt-tokens=61",
            "--completion-tokens=512",
            "--model-params=0.5",
            f"--figure={figure}",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(("colocate", "server"))]
    assert len(rows) == 5 and figure.stat().st_size > 10_000
    steps = [float(line[26:].split()[0]) for line in rows]
    assert steps == sorted(steps)


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a calibration"):
        calibration.load(bad)
