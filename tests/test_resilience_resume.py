"""Which checkpoint a resume starts from, and the launches it refuses: rotation keeps a complete checkpoint through
every save, a run with history never silently starts over, and a resume is refused before anything loads when it
cannot continue the run as it was."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MOVING, Job, compose_train
from transformers import Trainer, TrainerCallback, TrainingArguments

from colocated_grpo.resilience import checkpoints
from colocated_grpo.run_files import read_json, read_jsonl


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class _KilledInSave(RuntimeError):
    pass


class _KillInSave(TrainerCallback):
    """Ends the process's training where a SIGKILL in the save would: the checkpoint written, not yet marked."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _KilledInSave


def _trainer(run_dir: Path, max_steps: int, *callbacks) -> Trainer:
    args = TrainingArguments(
        output_dir=str(run_dir),
        use_cpu=True,
        report_to=[],
        max_steps=max_steps,
        save_steps=1,
        save_total_limit=1,
        per_device_train_batch_size=2,
        logging_steps=1,
    )
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(16)]
    return Trainer(model=_Regression(), args=args, train_dataset=data, callbacks=list(callbacks))


def test_rotation_keeps_the_last_complete_checkpoint_until_the_next_one_is_marked(tmp_path):
    """transformers rotates inside its save, before `on_save` marks the new checkpoint: with save_total_limit=1 a kill
    between the two left only an unmarked checkpoint, and the next launch started over. Here the real save runs and
    the process stops right after it, before the mark: the previous checkpoint is still there and is resumed from."""
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", checkpoints.MARKED: True}))
    trainer = _trainer(tmp_path, 3, _KillInSave(2), checkpoints.mark_complete_callback())
    with pytest.raises(_KilledInSave):
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert [c.step for c in checkpoints.checkpoints(tmp_path)] == [1], "checkpoint-2 is unmarked"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\n" for s in (1, 2)))
    resume = checkpoints.plan(compose_train("trainer.max_steps=3"), tmp_path)
    assert resume.checkpoint.path.name == "checkpoint-1"

    # The next attempt: once a checkpoint is marked, the older complete ones beyond the limit go.
    checkpoints.remove_incomplete(tmp_path)
    _trainer(tmp_path, 3, checkpoints.mark_complete_callback()).train(str(resume.checkpoint.path))
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-3"]
    assert (tmp_path / "checkpoint-3" / checkpoints.COMPLETE).exists()


def test_a_checkpoint_is_durable_before_it_is_marked_and_the_mark_before_older_ones_go(tmp_path, monkeypatch):
    """Every file of a save is fsynced before complete.json is written, and the checkpoint's directory (the mark's
    name in it) after, before the previous checkpoint is deleted: a power loss cannot leave a mark on lost data."""
    import os

    (tmp_path / "run.json").write_text(json.dumps({"status": "running", checkpoints.MARKED: True}))
    synced, fsync = [], os.fsync

    def spy(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        marked = {c.name for c in tmp_path.glob("checkpoint-*") if (c / checkpoints.COMPLETE).exists()}
        synced.append((path, marked, sorted(c.name for c in tmp_path.glob("checkpoint-*"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    _trainer(tmp_path, 2, checkpoints.mark_complete_callback()).train()
    for step in (2, 1):
        name = f"checkpoint-{step}"
        saved = [p for p, marked, _ in synced if p.parent.name == name and name not in marked]
        assert saved, f"nothing of {name} was fsynced before its mark"
        if step == 2:  # checkpoint-1 is gone now (save_total_limit=1)
            written = {p for p in (tmp_path / name).rglob("*") if p.is_file() and p.name != checkpoints.COMPLETE}
            assert written <= set(saved), f"not durable before the mark: {sorted(written - set(saved))}"
        directory = [held for p, marked, held in synced if p == tmp_path / name and name in marked]
        assert directory, f"{name}'s directory was not fsynced after its mark"
        if step == 2:
            assert "checkpoint-1" in directory[0], "checkpoint-2's mark is durable before checkpoint-1 is deleted"


def test_a_file_of_another_rank_gone_before_its_fsync_is_left_to_that_rank(tmp_path):
    """A rank that reaches the mark's barrier first lists files another rank is still writing (a temp file renamed
    away a moment later, here a link to nothing): it fsyncs what is there and goes on to the mark."""
    from transformers import TrainerControl, TrainerState

    (tmp_path / "run.json").write_text(json.dumps({"status": "running", checkpoints.MARKED: True}))
    saved = tmp_path / "checkpoint-3"
    saved.mkdir()
    (saved / "model.safetensors").write_bytes(b"weights")
    (saved / ".tmpaa5JS4").symlink_to(saved / "renamed-away")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    checkpoints.mark_complete_callback().on_save(args, TrainerState(global_step=3), TrainerControl())
    assert checkpoints.latest(tmp_path) == checkpoints.Checkpoint(saved, 3)


def _history(run_dir: Path, steps: int, *saves: int) -> None:
    (run_dir / "run.json").write_text(json.dumps({"status": "running", checkpoints.MARKED: True, "attempts": [{}]}))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"train/global_step": s}) + "\n" for s in range(1, steps + 1))
    )
    for step in saves:
        (run_dir / f"checkpoint-{step}").mkdir()


def test_a_run_with_history_but_no_complete_checkpoint_is_refused_unless_restart_is_asked(tmp_path):
    _history(tmp_path, 5, 4)  # checkpoint-4 cut short, steps 1-5 logged
    with pytest.raises(checkpoints.ResumeError) as refused:
        checkpoints.plan(compose_train("trainer.max_steps=6"), tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert "holds metrics.jsonl up to step 5 and checkpoint-4 (none complete)" in message
    assert "run.resume=restart starts it over from step 0" in message
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"], "nothing removed"
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 5, "nothing trimmed"

    resume = checkpoints.plan(compose_train("trainer.max_steps=6", "run.resume=restart"), tmp_path)
    assert resume.resuming and resume.checkpoint is None

    (tmp_path / "checkpoint-4" / checkpoints.COMPLETE).write_text(json.dumps({"global_step": 4}))
    with pytest.raises(checkpoints.ResumeError, match=r"restart starts over only a run without a complete checkpoint"):
        checkpoints.plan(compose_train("trainer.max_steps=6", "run.resume=restart"), tmp_path)


def _made_with(run_dir: Path) -> Path:
    """The model cache of the xdist worker that made the run: its model's path is part of the config a resume must
    match, and each worker has a cache of its own."""
    return Path(yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["cache_dir"])


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to, symlinks=True)
    return to


def test_a_resume_with_save_total_limit_1_starts_from_the_complete_checkpoint_and_rotates_after_marking(
    moving_run, tmp_path
):
    """A real run's directory in the state a kill in the save left it: checkpoint-6 saved but unmarked, checkpoint-4
    complete. The resume starts from checkpoint-4, and with save_total_limit=1 each later save keeps one checkpoint."""
    run_dir = _copy(moving_run.dir, tmp_path / "run")
    (run_dir / "checkpoint-6" / checkpoints.COMPLETE).unlink()
    _killed(run_dir)

    job = Job(run_dir, _made_with(run_dir), *MOVING, "trainer.max_steps=8", "trainer.save_total_limit=1")
    assert job.wait() == 0, job.output[-6000:]
    assert "from checkpoint-4, step 4" in job.output
    assert job.steps() == list(range(1, 9))
    assert [p.name for p in run_dir.glob("checkpoint-*")] == ["checkpoint-8"]
    assert [(a["from_step"], a["status"]) for a in read_json(run_dir / "run.json")["attempts"]] == [
        (0, "died"),
        (4, "finished"),
    ]


def _killed(run_dir: Path) -> dict:
    """The run's record as a SIGKILL leaves it: the last attempt still running."""
    record = read_json(run_dir / "run.json")
    record["status"] = "running"
    record["attempts"][-1].pop("status")
    record["attempts"][-1].pop("ended", None)
    (run_dir / "run.json").write_text(json.dumps(record))
    return record


def test_a_resume_with_another_world_size_is_refused_before_anything_loads(moving_run, tmp_path):
    """The one-process run resumed under torchrun with two: one line naming both and the launch that continues it."""
    run_dir = _copy(moving_run.dir, tmp_path / "run")
    before = _killed(run_dir)
    job = Job(run_dir, _made_with(run_dir), *MOVING, "trainer.max_steps=8", nproc=2)
    assert job.wait() != 0
    line = next(line for line in job.output.splitlines() if line.startswith("ResumeError:"))
    assert "was trained by 1 process(es) with parallelism=ddp, and this launch has 2 with parallelism=ddp" in line
    assert line.endswith(f"train.py {shlex.join(MOVING)} hydra.run.dir={run_dir}")
    assert ": python " in line
    assert "Loading weights" not in job.output and "vLLM" not in job.output
    after = read_json(run_dir / "run.json")
    assert after["world_size"] == before["world_size"] == 1
    # The killed attempt is recorded as what it was, not left running: nothing else of the record changes.
    assert (after["status"], [a["status"] for a in after["attempts"]]) == ("died", ["died"])
    assert {k: v for k, v in after.items() if k not in ("status", "attempts")} == {
        k: v for k, v in before.items() if k not in ("status", "attempts")
    }
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 6, "nothing trimmed"


def test_a_resume_with_another_parallelism_is_refused_naming_both(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_train("parallelism=fsdp", "trainer.max_steps=6")
    (tmp_path / "run.json").write_text(
        json.dumps({"status": "running", "world_size": 2, checkpoints.MARKED: True, "overrides": ["parallelism=ddp"]})
    )
    (tmp_path / "config.yaml").write_text("parallelism:\n  name: ddp\n")
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / checkpoints.COMPLETE).write_text(json.dumps({"global_step": 2}))
    with pytest.raises(checkpoints.ResumeError) as refused:
        checkpoints.plan(cfg, tmp_path)
    message = str(refused.value)
    assert "by 2 process(es) with parallelism=ddp, and this launch has 2 with parallelism=fsdp" in message
    assert message.endswith(f"torchrun --nproc_per_node=2 {sys.argv[0]} parallelism=ddp hydra.run.dir={tmp_path}")


def test_a_refused_launch_records_the_killed_attempt_it_found_as_died(tmp_path):
    from colocated_grpo.resilience import attempts

    running = {"status": "running", "world_size": 2, "attempts": [{"status": "died"}, {"started": "t1"}]}
    (tmp_path / "run.json").write_text(json.dumps(running))
    attempts.record_refusal(tmp_path, checkpoints.ResumeError("refused"), {"world_size": 1})
    assert read_json(tmp_path / "run.json") == {
        "status": "died",
        "world_size": 2,
        "attempts": [{"status": "died"}, {"started": "t1", "status": "died"}],
    }
    failed = {"status": "failed", "attempts": [{"status": "failed"}]}
    (tmp_path / "run.json").write_text(json.dumps(failed))
    attempts.record_refusal(tmp_path, checkpoints.ResumeError("refused"), {"world_size": 1})
    assert read_json(tmp_path / "run.json") == failed, "a run that recorded its end keeps its record"


def test_after_a_refused_first_launch_a_checkpoint_cut_short_on_other_ranks_is_not_resumed_from(tmp_path):
    """The refusal's run.json is the record the next launch continues: it keeps the rule that a checkpoint is complete
    once marked, so rank 0's trainer_state.json alone (the other ranks' saves cut short) is not taken for complete."""
    from colocated_grpo.resilience import attempts

    attempts.record_refusal(tmp_path, checkpoints.ResumeError("refused"), {"world_size": 2})
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / checkpoints.TRAINER_STATE).write_text(json.dumps({"global_step": 2}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\n" for s in (1, 2)))
    assert checkpoints.latest(tmp_path) is None
    with pytest.raises(checkpoints.ResumeError, match=r"checkpoint-2 \(none complete\)"):
        checkpoints.plan(compose_train("trainer.max_steps=4"), tmp_path)


def _complete(run_dir: Path, *steps: int) -> None:
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "world_size": 2, checkpoints.MARKED: True}))
    (run_dir / "metrics.jsonl").write_text("")
    for step in steps:
        (run_dir / f"checkpoint-{step}").mkdir()
        (run_dir / f"checkpoint-{step}" / checkpoints.COMPLETE).write_text(json.dumps({"global_step": step}))


def test_every_rank_takes_rank_0s_resume_decision_from_the_launchs_store(tmp_path, monkeypatch):
    """Under torchrun the ranks reach the agent's store before any process group exists: rank 0 posts its decision
    (or its refusal) there, and a rank whose view of the file system lags (checkpoint-4 not there yet) takes it."""
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port)}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rank0, rank1 = tmp_path / "rank0", tmp_path / "rank1"
    rank0.mkdir(), rank1.mkdir()
    _complete(rank0, 2, 4)
    _complete(rank1, 2)
    cfg = compose_train("trainer.max_steps=6")
    assert checkpoints.plan(cfg, rank0).checkpoint.path == rank0 / "checkpoint-4"
    assert checkpoints.plan(cfg, rank1, main=False).checkpoint == checkpoints.Checkpoint(rank1 / "checkpoint-4", 4)

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the agent restarted its workers: a new decision
    with pytest.raises(checkpoints.ResumeError) as refused:
        checkpoints.plan(compose_train("trainer.max_steps=4"), rank0)
    with pytest.raises(checkpoints.ResumeError) as same:
        checkpoints.plan(cfg, rank1, main=False)
    assert str(same.value) == str(refused.value) and "reached trainer.max_steps=4" in str(same.value)


# One rank of a launch without torchrun's agent (srun, the DeepSpeed launcher): RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT only. It plans its resume on its own view of the run directory, then joins the process group.
RANK = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from omegaconf import OmegaConf
from colocated_grpo.resilience import checkpoints

steps = int(sys.argv[2])
cfg = OmegaConf.create({"run": {"resume": "auto"}, "trainer": {"max_steps": steps}, "parallelism": {"name": "ddp"}})
try:
    said = checkpoints.plan(cfg, Path(sys.argv[1]), main=os.environ["RANK"] == "0").checkpoint.path.name
    dist.init_process_group("gloo")
    dist.all_reduce(ones := torch.ones(1))
    said += f", process group of {ones.item():.0f}"
except checkpoints.ResumeError as refused:
    said = f"refused: {refused}"
print(json.dumps(said))
"""


def test_without_torchruns_agent_every_rank_takes_rank_0s_decision_and_its_refusal(tmp_path):
    """The ranks of another launcher reach a store rank 0 hosts at MASTER_PORT, which the process group then joins:
    a rank whose view lags (checkpoint-4 not there yet) resumes where rank 0 does, and rank 0's refusal is theirs."""
    import os
    import subprocess

    from colocated_grpo.launch.processes import free_port

    script = tmp_path / "rank.py"
    script.write_text(RANK)
    views = [tmp_path / "rank0", tmp_path / "rank1"]
    for view, steps in zip(views, [(2, 4), (2,)], strict=True):
        view.mkdir()
        _complete(view, *steps)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD"))}

    def launch(max_steps: int) -> list[str]:
        common = {**env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(view), str(max_steps)],
                env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank, view in enumerate(views)
        ]
        return [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in ranks]

    assert launch(6) == ["checkpoint-4, process group of 2"] * 2
    rank0, rank1 = launch(4)
    assert rank0 == rank1 and "reached trainer.max_steps=4" in rank1
