"""Checkpoints and resume: checkpoints land in `<run_dir>/checkpoint-<step>` (the run directory is the trainer's
output directory); running again with the same `hydra.run.dir` continues the run (`run.resume=auto`) from the newest
complete checkpoint, with the same config (bar MAY_CHANGE), the run files cut back to it and the same W&B run."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from colocated_grpo import run_files
from colocated_grpo.resilience.redaction import REDACTED, redact_text
from colocated_grpo.run_files import STEP_KEY, flatten, read_json, read_jsonl

log = logging.getLogger(__name__)

RESUME_MODES = ("auto", "never", "restart")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"  # rank 0's, written last by transformers' _save_checkpoint
COMPLETE = "complete.json"  # written by MarkComplete once every rank has saved
MARKED = "checkpoints_marked"  # in run.json; an unmarked run's checkpoints are complete by their trainer_state.json

# Keys that may change between the attempts of one run: how long it runs, how it checkpoints and logs, and
# machine-local settings. Any other change would silently turn the resumed run into a different experiment.
MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.num_train_epochs",
    "trainer.save_strategy",
    "trainer.save_steps",
    "trainer.save_total_limit",
    "trainer.logging_steps",
    "trainer.vllm_gpu_memory_utilization",
    "trainer.dataloader_num_workers",
    "placement.fast_outputs",  # the same tokens and log-probs either way
    "placement.fast_sync",  # the same weights reach the engine either way
    "placement.sync_chunk_gb",
    "placement.one_forward",  # the same loss either way
    "run.pack_micro_batches",  # the same log-probs and loss either way
    "run.balance_micro_batches",  # each optimizer step keeps its rows: the same loss
    "trainer.gradient_checkpointing",  # recomputes activations: the same gradients, less memory
    "run.auto_memory",  # chooses gradient checkpointing only
    # server placement picks free ports at every launch
    "trainer.vllm_server_host",
    "trainer.vllm_server_port",
    "trainer.vllm_group_port",
    "telemetry",
    "run.resume",
    "run.stop_on_nonfinite",
    "run.cpu_kvcache_gb",
    "run.cache_dir",
    "logger.tags",
    "logger.group",
    "logger.init_timeout_s",
)


class ResumeError(RuntimeError):
    """The run directory cannot be (re)used as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


class Unreadable(NamedTuple):
    """A checkpoint whose state cannot be read (permissions, I/O error): neither resumed from nor deleted."""

    path: Path
    step: int  # from its name
    error: OSError


def _checkpoint_dirs(run_dir: Path):
    """(directory, state) of every checkpoint-N: its completed step, None for a save cut short, or Unreadable."""
    legacy = not (read_json(Path(run_dir) / run_files.RUN) or {}).get(MARKED)
    for path in Path(run_dir).glob(run_files.CHECKPOINT_PREFIX + "*"):
        if (m := _CHECKPOINT.match(path.name)) and path.is_dir():
            yield path, _state(path, int(m[1]), legacy)


def _state(path: Path, step: int, legacy: bool) -> int | Unreadable | None:
    """The step a complete checkpoint holds (COMPLETE, or a legacy run's TRAINER_STATE); None for a save cut short."""
    name = TRAINER_STATE if legacy else COMPLETE
    try:
        return int(json.loads((path / name).read_text())["global_step"])
    except FileNotFoundError:
        return None
    except OSError as err:
        return Unreadable(path, step, err)
    except (ValueError, KeyError, TypeError):
        return None if legacy else Unreadable(path, step, OSError("malformed " + name))


def checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints in the run directory, oldest first."""
    found = [Checkpoint(path, step) for path, step in _checkpoint_dirs(run_dir) if isinstance(step, int)]
    return sorted(found, key=lambda c: c.step)


def latest(run_dir: Path) -> Checkpoint | None:
    return (checkpoints(run_dir) or [None])[-1]


def mark_complete_callback():
    """A trainer callback: once every rank has saved a checkpoint, rank 0 marks it complete (a resume ignores an
    unmarked one) and only then deletes the oldest complete ones beyond `save_total_limit`. transformers' own
    rotation, which runs inside the save before the mark, is turned off: it could delete the last complete checkpoint
    while the new one is still unmarked. (Built here so that this module imports without transformers: the run-dir
    guard imports it.)"""
    from accelerate import PartialState
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        keep = None

        def on_train_begin(self, args, state, control, **kwargs):
            if args.save_total_limit is not None:
                self.keep, args.save_total_limit = args.save_total_limit, None

        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"{run_files.CHECKPOINT_PREFIX}{state.global_step}"
            started = time.monotonic()
            _fsync(*sorted(path.rglob("*"), reverse=True), path)  # this rank's part (and the rest seen here)
            synced = time.monotonic() - started
            PartialState().wait_for_everyone()  # what Accelerator.wait_for_everyone runs; no-op on one process
            if state.is_world_process_zero:
                log.info("%s: made durable (fsync) in %.2f s", path.name, synced)
                run_files.write_json(path / COMPLETE, {"global_step": state.global_step, "ranks": args.world_size})
                _fsync(path, path.parent)  # the mark's name and the checkpoint's, before older ones go
                for old in checkpoints(args.output_dir)[: -self.keep] if self.keep and self.keep > 0 else []:
                    if str(old.path) != state.best_model_checkpoint:
                        for name in (COMPLETE, TRAINER_STATE):  # unmarked first: a cut deletion is not resumed from
                            (old.path / name).unlink(missing_ok=True)
                        shutil.rmtree(old.path, ignore_errors=True)

    return MarkComplete()


def _fsync(*paths: Path) -> None:
    """Make files durable, and directories' entries (the names of what they hold)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # another rank's temp file, renamed since: that rank makes its own part durable
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def quiet_tied_weights_on_resume(model) -> None:
    """Drop transformers' missing-keys warning on resume when every missing key is a tied weight of `model` (e.g.
    `lm_head.weight` with tied embeddings: the checkpoint stores it once and loading ties it again)."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})

    def shown(record: logging.LogRecord) -> bool:
        m = re.match(r"There were missing keys in the checkpoint model loaded: \[(.*)\]\.$", record.getMessage())
        missing = {k.strip().strip("'\"") for k in m[1].split(",") if k.strip()} if m else set()
        return not (missing and missing <= tied)

    if tied:
        logging.getLogger("transformers.trainer").addFilter(shown)


@dataclass
class Resume:
    """Where this attempt starts: a new run, step 0 of a run that never checkpointed, or a checkpoint."""

    checkpoint: Checkpoint | None = None
    previous: dict = field(default_factory=dict)  # the previous attempt's run.json

    @property
    def resuming(self) -> bool:
        return bool(self.previous)

    @property
    def step(self) -> int:
        return self.checkpoint.step if self.checkpoint else 0

    @property
    def wandb_id(self) -> str | None:
        return self.previous.get("wandb_id")


def plan(cfg: DictConfig, run_dir: Path, main: bool = True) -> Resume:
    """How this attempt starts; ResumeError where the run directory cannot be used as asked. Rank 0 decides and
    checks; the other ranks take its decision (or its refusal) from the launch's store, since their own look at the
    file system may differ (another node's view of a network filesystem, a save being removed)."""
    run_dir, store = Path(run_dir), _launch_store(main)
    key = "colocated_grpo/resume/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart is a new launch
    if not main:
        if store is None:  # no rendezvous to share it through (nor then a process group): each decides as rank 0 does
            return Resume(latest(run_dir) if cfg.run.resume == "auto" else None)
        decided = json.loads(store.get(key))
        store.add(key + "/read", 1)
        if "refused" in decided:
            raise ResumeError(decided["refused"])
        name = decided["checkpoint"]
        return Resume(Checkpoint(run_dir / name, decided["step"]) if name else None)
    try:
        resume = _decide(cfg, run_dir)
    except Exception as err:
        if store is not None:
            store.set(key, json.dumps({"refused": str(err) if isinstance(err, ResumeError) else f"rank 0: {err!r}"}))
            if _held_stores:  # hosted here: alive until every rank has read the refusal (or 30 s)
                for _ in range(300):
                    if store.add(key + "/read", 0) >= int(os.environ["WORLD_SIZE"]) - 1:
                        break
                    time.sleep(0.1)
        raise
    if store is not None:
        decided = {"checkpoint": resume.checkpoint and resume.checkpoint.path.name, "step": resume.step}
        store.set(key, json.dumps(decided))
    return resume


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the process group joins the store at MASTER_PORT
_held_stores = []  # the stores this process hosts: a plain `python train.py`'s, or rank 0's without an agent store


def _launch_store(main: bool):
    """The store every rank reaches before any process group exists (None for one process, or no MASTER_PORT):
    torchrun's agent's; for a launcher without one (srun, the DeepSpeed launcher), one that rank 0 hosts at
    MASTER_PORT and that the process group then joins as torchrun's workers join their agent's."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "MASTER_PORT" not in os.environ:
        return None
    host = main and os.environ.get(AGENT_STORE) != "True"
    store = store_at(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), host)
    os.environ[AGENT_STORE] = "True"
    return store


def store_at(address: str, port: int, host: bool):
    """torch's TCPStore at address:port (port 0: a free one): hosted here, alive as long as the process; or joined."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(address, port, is_master=host, timeout=timedelta(minutes=10), wait_for_workers=False)
    if host:
        _held_stores.append(store)
    return store


def _decide(cfg: DictConfig, run_dir: Path) -> Resume:
    previous = read_json(run_dir / run_files.RUN) or {}
    if not previous and not (run_dir / run_files.METRICS).exists():
        return Resume()
    mode = str(cfg.run.resume)
    status = previous.get("status", "unknown")
    if mode == "never":
        raise ResumeError(
            f"{run_dir} already holds a run (status: {status}) and run.resume=never does not reuse it; "
            "choose a new hydra.run.dir, or set run.resume=auto to continue that run"
        )
    checkpoint = latest(run_dir)
    unreadable = [s for _, s in _checkpoint_dirs(run_dir) if isinstance(s, Unreadable)]
    if newer := sorted((u for u in unreadable if checkpoint is None or u.step > checkpoint.step), key=lambda u: u.step):
        raise ResumeError(
            f"{run_dir}: cannot tell whether {', '.join(u.path.name for u in newer)} is complete "
            f"({newer[-1].error.strerror or newer[-1].error}: {newer[-1].error.filename or newer[-1].path}), so it "
            "is neither resumed from nor deleted; make it readable and run again, or move it out of the run "
            "directory to resume from " + (checkpoint.path.name if checkpoint else "the start")
        )
    if checkpoint is None:
        if status == "finished":
            raise ResumeError(
                f"{run_dir} holds a finished run without checkpoints, so there is nothing to continue from and "
                "starting over would overwrite its results; choose a new hydra.run.dir"
            )
        if (history := _history(run_dir)) and mode != "restart":
            raise ResumeError(
                f"{run_dir} holds {history} but no complete checkpoint (status: {status}), so it cannot be resumed; "
                "run.resume=restart starts it over from step 0 in this directory, dropping those records, or choose "
                "a new hydra.run.dir"
            )
        log.warning(f"{run_dir} holds an unfinished run without a checkpoint (status: {status}): starting it over")
        return Resume(None, previous)
    if mode == "restart":
        raise ResumeError(
            f"run.resume=restart starts over only a run without a complete checkpoint, but {run_dir} holds "
            f"{checkpoint.path.name}; use run.resume=auto to continue from it, or choose a new hydra.run.dir"
        )
    check_launch(cfg, run_dir, previous)
    check_config(cfg, run_dir, previous)
    max_steps = int(cfg.trainer.get("max_steps") or -1)
    if 0 < max_steps <= checkpoint.step:  # resuming would still train one more step
        raise ResumeError(
            f"{run_dir} holds a run that reached trainer.max_steps={max_steps} (checkpoint-{checkpoint.step}, "
            f"status: {status}): nothing is left to train. Raise trainer.max_steps to extend it, or choose a new "
            "hydra.run.dir"
        )
    return Resume(checkpoint, previous)


def _history(run_dir: Path) -> str:
    """What a run directory holds of trained steps: its metric rows and checkpoint directories ('' for nothing)."""
    steps = [r[STEP_KEY] for r in read_jsonl(run_dir / run_files.METRICS) if r.get(STEP_KEY) is not None]
    saves = sorted((path.name for path, _ in _checkpoint_dirs(run_dir)), key=lambda name: int(name.split("-")[1]))
    held = [f"metrics.jsonl up to step {max(steps)}"] if steps else []
    return " and ".join(held + ([f"{', '.join(saves)} (none complete)"] if saves else []))


def check_launch(cfg: DictConfig, run_dir: Path, previous: dict) -> None:
    """Raise ResumeError when this launch has another world size or parallelism than the run: a checkpoint holds the
    state (optimizer shards, RNG) of the ranks and the sharding that wrote it."""
    stored = OmegaConf.load(run_dir / run_files.CONFIG) if (run_dir / run_files.CONFIG).exists() else cfg
    world = int(os.environ.get("WORLD_SIZE", "1"))
    was = (int(previous.get("world_size", world)), str(OmegaConf.select(stored, "parallelism.name")))
    if was != (world, str(cfg.parallelism.name)):
        raise ResumeError(
            f"{run_dir} was trained by {was[0]} process(es) with parallelism={was[1]}, and this launch has {world} "
            f"with parallelism={cfg.parallelism.name}; its checkpoints hold the state of the ranks and the sharding "
            f"that wrote them, so continue it as it was launched: "
            + launch_command(run_dir, previous.get("overrides"), was[0])
        )


def launch_command(run_dir: Path, overrides: list[str] | None, world: int, nproc: int | None = None) -> str:
    """The command line that runs these overrides in `run_dir` with `world` processes (`nproc` on this node)."""
    if overrides is None:
        return f"the same command with {world} process(es) and hydra.run.dir={run_dir}"
    launcher = ["python"] if world == 1 else ["torchrun", f"--nproc_per_node={nproc or world}"]
    args = [shlex.quote(redact_text(o)) for o in overrides]
    return " ".join([*launcher, sys.argv[0], *args, f"hydra.run.dir={shlex.quote(str(run_dir))}"])


def check_config(cfg: DictConfig, run_dir: Path, previous: dict) -> None:
    """Raise ResumeError when the config differs from the one the run was started with (beyond MAY_CHANGE)."""
    stored_path = Path(run_dir) / run_files.CONFIG
    if not stored_path.exists():
        return
    stored = flatten(OmegaConf.to_container(OmegaConf.load(stored_path), resolve=False))
    current = flatten(OmegaConf.to_container(cfg, resolve=True))
    changed = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key, "<unset>"), current.get(key, "<unset>")
        if old in (new, REDACTED) or any(key == k or key.startswith(k + ".") for k in MAY_CHANGE):
            continue
        changed.append(f"{key}: {old!r} -> {new!r}")
    if changed:
        overrides = previous.get("overrides")
        given = f": {' '.join(overrides) or '(none)'}" if overrides is not None else ""
        raise ResumeError(
            f"{run_dir} was started with a different config, so it cannot be resumed with this one:\n  "
            + "\n  ".join(changed[:30])
            + f"\nTo continue that run, re-run it with the overrides it was started with{given} (plus "
            f"hydra.run.dir={run_dir}); to start a new run, choose a new "
            f"hydra.run.dir. Keys that may change on resume: {', '.join(MAY_CHANGE)}."
        )


def trim_run_files(run_dir: Path, step: int) -> dict[str, int]:
    """Drop records of steps after `step` from every per-step JSONL file, a line at a time, so the resumed run appends
    without duplicates or gaps (a torn last line of a killed writer goes too). Returns the dropped count per file."""
    dropped = {}
    for path in sorted(Path(run_dir).glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            if cut := sum(not _kept(line, step) for line in f):
                f.seek(0)
                run_files.write_text(path, (line.rstrip("\n") + "\n" for line in f if _kept(line, step)))
                dropped[path.name] = cut
    return dropped


def _kept(line: str, step: int) -> bool:
    """A whole record of `step` or before, or of no step."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return record.get(STEP_KEY) is None or record[STEP_KEY] <= step


def remove_incomplete(run_dir: Path) -> list[str]:
    """Remove saves known to be cut short (readable, and not marked complete); they cannot be resumed from, and
    transformers' rotation would count them. A checkpoint whose state cannot be read is kept."""
    removed = []
    for path, step in _checkpoint_dirs(run_dir):
        if step is None:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed
