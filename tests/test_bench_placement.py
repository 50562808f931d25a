"""The placement predictor: its calibration from the committed one-GPU results (multi-GPU jobs left out), the
per-phase model, the validation against the committed multi-GPU jobs, and the command line."""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest

from colocated_grpo.bench.placement import calibration, validation
from colocated_grpo.bench.placement.__main__ import main
from colocated_grpo.bench.placement.model import Placement, Workload, placements, predict
from colocated_grpo.bench.study import definition as study_definition
from colocated_grpo.provenance import REPO

RESULTS = REPO / "sweeps" / "results"
MODEL_DIR = RESULTS / "placement_model"
CALIBRATION = MODEL_DIR / "calibration_h200.json"
STUDY = RESULTS / "calibration_h200"
# The calibration subset the study definition names (its `calibrate` key); the rest of the study is held out.
SUBSET = study_definition.load(REPO / "sweeps" / "studies" / "calibration_h200.yaml")["calibrate"]
# one-GPU jobs of other studies (other commits and micro-batches): held out as well
OTHER_ONE_GPU = [RESULTS / "plain_trl_h200", RESULTS / "parallelism_h200"]
MULTI_GPU = [
    RESULTS / "h200_x2",
    RESULTS / "tp_x_gpu_mem_1.5b" / "tp1_tp2_first_run",
    RESULTS / "tp_x_gpu_mem_1.5b" / "tp2_mem0.5_0.7",
]


@pytest.fixture(scope="module")
def built():
    return calibration.build([STUDY], only=SUBSET)


def to_12_digits(text: str):
    """JSON with each number to 12 significant digits: fits summed in another order (Python 3.12's sum() compensates
    rounding, 3.11's does not) differ in the last digits."""
    return json.loads(text, parse_float=lambda number: float(f"{float(number):.12g}"))


def test_the_committed_calibration_is_what_calibrate_builds_from_the_subset(built):
    assert to_12_digits(json.dumps(built)) == to_12_digits(CALIBRATION.read_text())
    assert built["sources"] and all(any(fnmatch(_case(s), p) for p in SUBSET) for s in built["sources"])
    m = built["models"]["qwen2.5-1.5b"]
    assert [b for b, _ in m["generate"]["fast"]] == [32, 128, 256]
    assert m["sync_s"]["trl"] > 5 * m["sync_s"]["fast"] and m["sleep_wake_s"] > 0
    assert 1e-5 < m["train"]["s_per_token"] < 1e-4
    assert 240 < m["completion_tokens"] <= 256, "natural stop: random weights seldom end a completion early"


def test_calibrate_only_calibrates_from_the_matching_jobs_and_holds_out_the_rest():
    one = calibration.build([STUDY], only=["*1.5b/fast_b32_l256"])
    assert [_case(s) for s in one["sources"]] == ["qwen2.5-1.5b/fast_b32_l256"]
    assert {"qwen2.5-1.5b fast_b128_l256 (1 GPUs)", "qwen2.5-0.5b fast_b32_l256 (1 GPUs)"} <= set(one["left_out"])
    assert one["only"] == ["*1.5b/fast_b32_l256"] and list(one["models"]) == ["qwen2.5-1.5b"]
    assert [b for b, _ in one["models"]["qwen2.5-1.5b"]["generate"]["fast"]] == [32]


def _case(source: str) -> str:
    """runs/<model option>/<case> → <model>/<case>, as calibrate's patterns read it."""
    model, case = source.split("/")[-2:]
    return f"{model.removesuffix('-random')}/{case}"


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
    assert not any("CUDA graph" in f for f in server.flags), "256 sequences on its one engine"
    crowded = predict(built, Workload(1024, 61, 256, 1.544), Placement("server", 8, server_gpus=1, request="trl"))
    assert any("1024 sequences decode at once, past vLLM's largest CUDA graph" in f for f in crowded.flags)
    longer = predict(built, Workload(256, 61, 1024, 1.544), Placement("colocate", 8))
    assert longer.phases["generate"] > 4 * eight.phases["generate"], "4× the tokens and a longer context"


def test_each_colocated_placement_is_predicted_at_its_best_memory_share(built):
    small, large = Workload(128, 61, 256, 1.544), Workload(1024, 61, 1024, 1.544)
    for work in (small, large):
        best = predict(built, work, Placement("colocate", 1))
        assert best.fits and best.placement.mem is not None and "share" in best.placement.name
        for share in (0.3, 0.5):
            assert best.step_s <= 1.01 * predict(built, work, Placement("colocate", 1, mem=share)).step_s
    assert (
        predict(built, large, Placement("colocate", 1)).placement.mem
        > predict(built, small, Placement("colocate", 1)).placement.mem
    ), "a larger batch of longer completions needs a larger KV cache"
    tiny = predict(built, small, Placement("colocate", 1, mem=0.02))
    assert not tiny.fits and any("no room" in f for f in tiny.flags)


def test_no_phase_takes_negative_time_at_a_size_extrapolated_from_two(built):
    # at 7.6 B, both lines' intercepts, carried on from 0.5 B and 1.5 B, are below zero
    m = {name: built["models"][name] for name in ("qwen2.5-0.5b", "qwen2.5-1.5b")}
    assert m["qwen2.5-1.5b"]["other"]["fixed_s"] < m["qwen2.5-0.5b"]["other"]["fixed_s"]
    for gpus, completions in ((1, 32), (8, 128)):
        for placement in placements(gpus):
            p = predict(built, Workload(completions, 150, 512, 7.616), placement)
            assert min(p.phases.values()) >= 0.0, (placement.name, p.phases)
            assert any("extrapolated" in f for f in p.flags)


def test_trl_s_extra_forward_is_added_where_it_was_measured(built):
    cal = json.loads(json.dumps(built))
    cal["models"]["qwen2.5-1.5b"]["added_s_per_token"]["extra_forward"] = {"other": 1e-5}
    work = Workload(128, 61, 256, 1.544)
    one = predict(cal, work, Placement("colocate", 1, mem=0.3))
    two = predict(cal, work, Placement("colocate", 1, mem=0.3, one_forward=False))
    assert two.phases["other"] - one.phases["other"] == pytest.approx(1e-5 * 128 * 317)
    for phase in ("generate", "sync_weights", "sleep_wake", "reward", "train"):
        assert two.phases[phase] == one.phases[phase]


def test_the_committed_validation_is_what_validate_makes_of_the_kept_runs(built):
    table = validation.rows(built, [STUDY, *OTHER_ONE_GPU, *MULTI_GPU])
    held_out = [r for r in table if "error" in r and not r["in_sample"] and r["gpus"] == 1]
    multi = [r for r in table if not r["in_sample"] and r["gpus"] > 1]
    assert held_out and len(multi) == 18 and any("error" in r for r in multi)
    assert {r["note"].split(":")[0] for r in table if "error" not in r} == {"not modelled"}
    committed = (MODEL_DIR / "validation.md").read_text()
    assert validation.markdown(table) in committed, "validation.md is what `validate` makes of the kept runs"
    assert f"held out (one GPU, not calibrated from): {len(held_out)} jobs" in committed


def test_scaling_prints_one_gpu_over_batch_and_length_and_draws_it(tmp_path, capsys):
    figure = tmp_path / "scaling.png"
    main(["scaling", f"--calibration={CALIBRATION}", "--model-params=1.544", str(STUDY), f"--out={figure}"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("colocate")]
    assert len(rows) == 2 * 2 * 5 and figure.stat().st_size > 20_000
    colocate_256 = [float(r[3]) for r in rows if r[0] == "colocate" and r[1] == "256"]
    assert colocate_256 == sorted(colocate_256), "a larger batch takes longer"
    assert any(len(r) > 6 for r in rows), "a measured step beside its prediction"


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
            "--model-params=1.544",
            f"--figure={figure}",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(("colocate", "server"))]
    assert len(rows) == 5 and figure.stat().st_size > 10_000
    steps = [float(line[38:].split()[0]) for line in rows]
    assert steps == sorted(steps)
    # beside each prediction, the error the committed validation measured for multi-GPU jobs (docs/placement.md)
    assert lines[1].split()[:4] == ["placement", "step", "s", "±"]
    error = validation.committed(4)["median"]
    assert round(error, 3) == 0.315
    assert [float(line[38:].split()[1]) for line in rows] == pytest.approx([s * error for s in steps], abs=0.01)
    assert (
        "the model's median |error| on the 11 H200 jobs on several GPUs it was not calibrated from: 31.5%"
        in (lines[len(rows) + 2])
    )


WORKLOAD = ["--prompt-tokens=150", "--completion-tokens=1024", "--model-params=1.5"]


def test_predict_with_no_such_calibration_file_says_so_and_how_to_measure_one(tmp_path):
    with pytest.raises(SystemExit) as refused:
        main(["predict", f"--calibration={tmp_path / 'my_gpu.json'}", "--gpus=8", "--completions=512", *WORKLOAD])
    assert str(refused.value).startswith(f"{tmp_path / 'my_gpu.json'}: no such file. Measure your GPU into it with")
    assert "placement measure sweeps/studies/calibration_h200.yaml --dir DIR --out" in str(refused.value)


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a calibration"):
        calibration.load(bad)
