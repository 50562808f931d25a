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


# Every writer a save uses, each filling a real 1 MiB disk while it writes checkpoint-2 (checkpoint-1 complete): the
# runner's handler of a failed save (the same call as in training) says so in one line and removes checkpoint-2.
WRITERS = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
import torch.distributed.checkpoint as dcp
from colocated_grpo.launch import lifecycle

run_dir = Path(sys.argv[1])
(run_dir / "run.json").write_text(json.dumps({"checkpoints_marked": True}))
(run_dir / "checkpoint-1").mkdir()
(run_dir / "checkpoint-1" / "complete.json").write_text(json.dumps({"global_step": 1}))
big = {"weight": torch.zeros(2**20)}  # 4 MiB
writers = {
    "safetensors": lambda cut: save_file(big, cut / "model.safetensors"),  # save_pretrained's
    "torch.save": lambda cut: torch.save(big, cut / "optimizer.pt"),  # optimizer, scheduler, RNG, DeepSpeed
    "text": lambda cut: (cut / "trainer_state.json").write_text("x" * 2**22),  # JSON of transformers and ours
    "torch.distributed.checkpoint": lambda cut: dcp.save(big, checkpoint_id=cut / "pytorch_model_fsdp_0"),  # FSDP2
}
for name, write in writers.items():
    (cut := run_dir / "checkpoint-2").mkdir(exist_ok=True)
    try:
        write(cut)
    except BaseException as exc:
        full = lifecycle._explain_disk_full(exc, run_dir, main=True)
        left = sorted(p.name for p in run_dir.glob("checkpoint-*"))
        print(json.dumps({"writer": name, "error": type(exc).__name__, "said": full and str(full), "left": left}))
"""


def _on_a_1_mib_disk(tmp_path: Path, script: str):
    """Run `script` with a run directory on a real 1 MiB tmpfs of its own; the JSON lines it printed."""
    if shutil.which("unshare") is None:
        pytest.fail("this test needs util-linux's unshare (apt-get install util-linux)")
    (run_dir := tmp_path / "run").mkdir()
    (path := tmp_path / "script.py").write_text(script)
    shell = f"mount -t tmpfs -o size=1m tmpfs {run_dir} && {sys.executable} {path} {run_dir}"
    cmd = ["unshare", "--mount", "--propagation", "private", "--map-root-user", "bash", "-c", shell]
    proc = run_bounded(cmd, timeout=120)
    return run_dir, proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_writer_of_a_save_that_fills_the_disk_is_a_full_disk_and_its_cut_save_is_removed(tmp_path):
    run_dir, proc, results = _on_a_1_mib_disk(tmp_path, WRITERS)
    writers = ["safetensors", "torch.save", "text", "torch.distributed.checkpoint"]
    assert [r["writer"] for r in results] == writers, proc.stdout + proc.stderr
    assert [r["error"] for r in results] == ["SafetensorError", "RuntimeError", "OSError", "CheckpointException"]
    for r in results:
        said = f"no space left on the disk of the run directory {run_dir} ("
        assert (r["said"] or "").startswith(said) and "MiB free of 1.0 MiB" in r["said"], r
        assert r["said"].endswith("run the same command again to resume from checkpoint-1"), r
        assert r["left"] == ["checkpoint-1"], f"{r['writer']}: the save it cut short is removed"
    assert "No space left on device (os error 28)" in results[0]["said"], "safetensors' own words"


# A run whose save filled the disk, resumed while the disk is still full: checkpoint-2 complete, checkpoint-4 the save
# cut short, holding every byte left; steps 1-5 logged.
STILL_FULL = """
import json, os, sys
from pathlib import Path
from omegaconf import OmegaConf
from colocated_grpo.resilience import attempts, checkpoints

run_dir = Path(sys.argv[1])
(run_dir / "run.json").write_text(json.dumps({"status": "failed", "checkpoints_marked": True, "attempts": [{}]}))
(run_dir / "metrics.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\\n" for s in range(1, 6)))
(run_dir / "checkpoint-2").mkdir()
(run_dir / "checkpoint-2" / "complete.json").write_text(json.dumps({"global_step": 2}))
(run_dir / "checkpoint-4").mkdir()
def fill(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(2**16))
    except OSError:
        os.close(fd)

def resume():
    previous = json.loads((run_dir / "run.json").read_text())
    try:
        attempts.prepare_run_dir(OmegaConf.create({"trainer": {}}), run_dir, checkpoints.Resume(
            checkpoints.Checkpoint(run_dir / "checkpoint-2", 2), previous))
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    steps = [json.loads(line)["train/global_step"] for line in open(run_dir / "metrics.jsonl")]
    print(json.dumps({"error": error, "left": sorted(p.name for p in run_dir.glob("checkpoint-*")), "steps": steps}))

fill(run_dir / "checkpoint-4" / "model.safetensors")
resume()
# then full of something else: nothing to free, the records stay as they were
with open(run_dir / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"train/global_step": 3}) + "\\n")
fill(run_dir / "other")
resume()
"""


def test_a_resume_on_a_still_full_disk_frees_the_cut_save_before_it_rewrites_the_run_files(tmp_path):
    run_dir, proc, (freed, full) = _on_a_1_mib_disk(tmp_path, STILL_FULL)
    assert freed == {"error": None, "left": ["checkpoint-2"], "steps": [1, 2]}, proc.stdout + proc.stderr
    said = f"DiskFull: no space left on the disk of the run directory {run_dir} (0.0 MiB free of 1.0 MiB; OSError: "
    assert full["error"].startswith(said) and full["error"].endswith("then run the same command again"), full
    assert full["steps"] == [1, 2, 3], "nothing cut when there was no room to write"
