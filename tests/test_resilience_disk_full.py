"""A run whose disk fills up: one line naming the directory and the space left, run.json says failed, the save cut
short is not left behind as a checkpoint, and the same command resumes once there is room. The disk is a real
small tmpfs, mounted in a mount namespace of the test's own (`unshare`), so nothing outside the test sees it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import run_bounded

from colocated_grpo.launch.processes import TRAIN_SCRIPT
from colocated_grpo.resilience import checkpoints
from colocated_grpo.run_files import read_jsonl

# A checkpoint of the tiny model (weights and Adam state) takes about 5.5 MiB: an 8 MiB disk holds the run files and
# checkpoint-1, and runs out while checkpoint-2 is written.
SMALL_DISK, ROOMY_DISK = "8m", "64m"
OVERRIDES = ("placement=none", "trainer.max_steps=3", "trainer.save_steps=1")

SCRIPT = """
set -u
mount -t tmpfs -o size={small} tmpfs {run_dir}
{python} {train} {args} > {out}/full.log 2>&1; echo $? > {out}/full.rc
cp -a {run_dir}/. {out}/after_full/
mount -o remount,size={roomy} {run_dir}
{python} {train} {args} > {out}/rerun.log 2>&1; echo $? > {out}/rerun.rc
cp -a {run_dir}/. {out}/after_rerun/
"""


@pytest.fixture(scope="module")
def full_then_roomy(run_env, tmp_path_factory):
    if shutil.which("unshare") is None:
        pytest.fail("this test needs util-linux's unshare (apt-get install util-linux)")
    out = tmp_path_factory.mktemp("disk-full")
    run_dir = out / "run"
    for d in (run_dir, out / "after_full", out / "after_rerun"):
        d.mkdir()
    script = SCRIPT.format(
        small=SMALL_DISK,
        roomy=ROOMY_DISK,
        run_dir=run_dir,
        out=out,
        python=sys.executable,
        train=TRAIN_SCRIPT,
        args=" ".join([f"hydra.run.dir={run_dir}", *OVERRIDES]),
    )
    # --map-root-user: the mount needs no privileges outside the namespace
    cmd = ["unshare", "--mount", "--propagation", "private", "--map-root-user", "bash", "-c", script]
    proc = run_bounded(cmd, cwd=out, env=run_env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, run_dir


def _read(out: Path, name: str) -> str:
    return (out / name).read_text()


def test_a_full_disk_is_one_line_naming_the_directory_and_the_space_left(full_then_roomy):
    out, run_dir = full_then_roomy
    assert _read(out, "full.rc").strip() == "1"
    log = _read(out, "full.log")
    line = f"DiskFull: no space left on the disk of the run directory {run_dir} (0."
    assert line in log, log[-3000:]
    assert "MiB free of 8.0 MiB" in log
    assert "run the same command again to resume from checkpoint-1" in log
    assert "Traceback" not in log, log[-3000:]


def test_a_full_disk_is_recorded_and_leaves_no_cut_save_or_temp_file(full_then_roomy):
    out, _ = full_then_roomy
    after = out / "after_full"
    record = json.loads((after / "run.json").read_text())
    assert record["status"] == "failed"
    assert record["error"].startswith("DiskFull: no space left")
    assert not list(after.rglob("*.tmp")), "a failed write leaves no temp file"
    assert [c.step for c in checkpoints.checkpoints(after)] == [1]
    assert [p.name for p in after.glob("checkpoint-*")] == ["checkpoint-1"], "the save cut short is removed"
    assert (after / "checkpoint-1" / checkpoints.COMPLETE).exists()


def test_the_same_command_resumes_once_there_is_room(full_then_roomy):
    out, _ = full_then_roomy
    assert _read(out, "rerun.rc").strip() == "0", _read(out, "rerun.log")[-3000:]
    after = out / "after_rerun"
    record = json.loads((after / "run.json").read_text())
    assert record["status"] == "finished"
    assert [(a["from_step"], a["status"]) for a in record["attempts"]] == [(0, "failed"), (1, "finished")]
    steps = [r["train/global_step"] for r in read_jsonl(after / "metrics.jsonl") if "train/global_step" in r]
    assert sorted(set(steps)) == [1, 2, 3] and len(steps) == len(set(steps)), steps
