"""TRL's GRPOTrainer, timed, and the upstream guard. TimedGRPOTrainer only times TRL's steps (the phases:
docs/telemetry.md) and calls TRL's own code: the plain-TRL baseline runs it. Our changes build on it elsewhere: the
trainer's in training/trainer.py (ColocatedGRPOTrainer: the engine's seed, the importance-sampling ratio from the
training forward, packed and balanced micro-batches), the in-process engine's in generation/in_process.py (the flat
log-prob reader, the batched weight sync). Each change names the TRL methods it relies on with a digest of their
source as written for trl 1.16.0 (`WRITTEN_FOR`, here), checked on the class that runs (a subclass of ours that
overrides one is seen): where one differs, TRL's own code runs for that change and a WARNING names the speed lost."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
from contextlib import contextmanager, nullcontext

import trl
from torch.profiler import record_function
from trl import GRPOTrainer

try:  # where TRL 1.16 keeps its engine wrapper; a TRL that moves it runs its own generation (the guard says so)
    from trl.generation import vllm_generation
except ImportError:
    vllm_generation = None

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ the upstream guard

WRITTEN_FOR_VERSION = "1.16.0"
WRITTEN_FOR = {
    # TRL's generate returns (prompt ids, completion ids, …) per completion: the generated tokens counted from it
    "token counts": {"trl.trainer.grpo_trainer:GRPOTrainer._generate": "2a27fdf8f5e6"},
    "flat log-prob reader": {
        "trl.generation.vllm_generation:extract_logprobs": "ea9254b4a72d",
        # which calls extract_logprobs by its module's name: the seam our reader stands in at
        "trl.generation.vllm_generation:VLLMGeneration.generate": "2d2ac2be5b13",
    },
    "batched weight sync": {
        "trl.generation.vllm_generation:VLLMGeneration.sync_weights": "63d669fb3230",
        "trl.generation.vllm_generation:VLLMGeneration._iter_named_params": "baab615d5c7b",
    },
    "importance-sampling ratio from the training forward": {
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions": "1fa48922792d",
        "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs": "f824e7fb0714",
        "trl.trainer.grpo_trainer:GRPOTrainer.compute_loss": "a2d6ef8bd29c",
        "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss": "80295546bbdb",
        "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies": "ea73c3909275",
    },
    "packed micro-batches": {
        "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies": "ea73c3909275",
        "trl.trainer.utils:add_fused_lm_head": "422d009f04b6",  # the (rows, length - 1) log-probs it returns
    },
    "balanced micro-batches": {
        # the buffer of micro-batches it fills once a generation batch, and the losses that micro-batches' makeup
        # leaves unchanged
        "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs": "f824e7fb0714",
        "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss": "80295546bbdb",
    },
}
# What TRL's own code costs where a change falls back to it (one H200, docs/results.md).
SPEED_LOST = {
    "token counts": "no generated tokens counted: perf/tokens_per_s and perf/gen_tokens_per_s read 0",
    "flat log-prob reader": "slower generation: TRL's parser builds a dict per generated token",
    "batched weight sync": "a slower weight sync: one load_weights call per tensor (0.27 s instead of 0.02 s for 1.5B)",
    "importance-sampling ratio from the training forward": (
        "a slower step: TRL's extra no-grad forward over each generation batch (0.69 s of a step at 256 completions)"
    ),
    "packed micro-batches": "padded micro-batches: every sequence computed to the micro-batch's longest",
    "balanced micro-batches": "TRL's micro-batches, each padded to the generation batch's longest row",
}


OURS = "colocated_grpo."  # the package whose overrides reach TRL's methods through super()


def _running(target: str, cls: type | None) -> tuple[str, str | None]:
    """The name and source of what runs for `module:Class.method`: on `cls` (a subclass of Class), the first
    definition in its MRO that is not one of ours, which our overrides reach through super(); (name, None) where
    it does not exist."""
    module_name, _, qualname = target.partition(":")
    path, _, name = qualname.rpartition(".")
    try:
        owner = importlib.import_module(module_name)
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        if cls is not None and isinstance(owner, type) and issubclass(cls, owner):
            owner = next(k for k in cls.__mro__ if name in vars(k) and not k.__module__.startswith(OURS))
            qualname = f"{owner.__qualname__}.{name}"
        obj = getattr(owner, name)
        return qualname, inspect.getsource(getattr(obj, "trl_original", obj))  # ours installed: TRL's own
    except (ImportError, AttributeError, OSError, TypeError, StopIteration):
        return qualname, None


def changed_upstream(targets: dict[str, str], *classes: type) -> list[str]:
    """The methods of `targets` (`module:Class.method` -> the digest of the source it was written for) whose source,
    as each of `classes` runs it (subclasses of their Class), is another or gone."""
    changed = []
    for target, digest in targets.items():
        for name, source in (_running(target, cls) for cls in classes or (None,)):
            if (source is None or hashlib.sha256(source.encode()).hexdigest()[:12] != digest) and name not in changed:
                changed.append(name)
    return changed


def upstream_mismatch(change: str, cls: type | None = None) -> str | None:
    """None when every TRL method `change` relies on has the source it was written for (as `cls` runs it); else one
    line saying that TRL's own code runs, why, and the speed lost."""
    changed = changed_upstream(WRITTEN_FOR[change], cls)
    if not changed:
        return None
    return (
        f"{change}: TRL's own code runs: written for trl {WRITTEN_FOR_VERSION}, this is trl {trl.__version__} "
        f"and {', '.join(changed)} changed; {SPEED_LOST[change]}"
    )


# ------------------------------------------------------------------------------------ timing only: TRL's behaviour


def in_phase(tracker, name: str):
    return nullcontext() if tracker is None else tracker.phase(name)


# TRL's engine wrapper; without it (a TRL that moved it) the wrapper TRL builds keeps its own class
_VLLMGeneration = vllm_generation.VLLMGeneration if vllm_generation is not None else object


class TimedVLLMGeneration(_VLLMGeneration):
    """TRL's engine wrapper, its weight sync timed as the sync_weights phase."""

    phase_tracker = None  # a telemetry.phases.PhaseTracker (TimedGRPOTrainer.time_phases)

    def sync_weights(self):
        with in_phase(self.phase_tracker, "sync_weights"):
            return super().sync_weights()


class TimedGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with its steps timed as phases and its generated tokens counted; each override times and
    calls TRL's own. Phases nest: generate inside other (_prepare_inputs) inside train (training_step)."""

    vllm_generation_class = TimedVLLMGeneration
    phase_tracker = token_counter = None  # set by time_phases
    counts_tokens = True  # TRL's _generate returns what the counts read (the upstream guard)
    profile_label = None  # telemetry.profile's prefix: train, other and generate then run in torch.profiler ranges

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        timed = ("_prepare_inputs", "_generate", "_calculate_rewards")
        if missing := [name for name in timed if not hasattr(GRPOTrainer, name)]:
            log.warning("phase timings: this TRL's GRPOTrainer has no %s; those phases read 0", ", ".join(missing))
        if why_not := upstream_mismatch("token counts", type(self)):
            log.warning("%s", why_not)
            self.counts_tokens = False
        if isinstance(getattr(self, "vllm_generation", None), _VLLMGeneration) and vllm_generation is not None:
            # TRL 1.16 builds VLLMGeneration by name inside GRPOTrainer.__init__, with no factory to override: the
            # built object takes our subclass (methods only, no state of its own)
            self.vllm_generation.__class__ = self.vllm_generation_class
        elif getattr(self, "vllm_generation", None) is not None:
            log.warning("phase timings: this TRL has no trl.generation.vllm_generation; sync_weights reads 0")

    def time_phases(self, tracker, tokens) -> None:
        """Time TRL's steps as phases of `tracker` and count generated tokens into `tokens` (telemetry.phases)."""
        self.phase_tracker, self.token_counter = tracker, tokens
        if (generation := getattr(self, "vllm_generation", None)) is None:
            return
        generation.phase_tracker = tracker
        llm = getattr(generation, "llm", None)  # the in-process engine: colocate only
        if llm is not None and generation.enable_sleep_mode:
            # vLLM's LLM is built and called inside TRL's own VLLMGeneration methods: only its instance can be timed
            for name in ("sleep", "wake_up"):
                setattr(llm, name, tracker.phase("sleep_wake")(getattr(llm, name)))  # a contextmanager decorates too

    @contextmanager
    def _phase(self, name: str, labelled: bool = False):
        label = record_function(self.profile_label + name) if labelled and self.profile_label else nullcontext()
        with label, in_phase(self.phase_tracker, name):
            yield

    def training_step(self, *args, **kwargs):
        with self._phase("train", labelled=True):
            return super().training_step(*args, **kwargs)

    def _prepare_inputs(self, *args, **kwargs):
        with self._phase("other", labelled=True):
            return super()._prepare_inputs(*args, **kwargs)

    def _generate(self, *args, **kwargs):
        with self._phase("generate", labelled=True):
            result = super()._generate(*args, **kwargs)
        if self.token_counter is not None and self.counts_tokens:
            self.token_counter.count(result[0], result[1])
        return result

    def _calculate_rewards(self, *args, **kwargs):
        with self._phase("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def _clip_grad_norm(self, *args, **kwargs):
        with self._phase("train"):
            return super()._clip_grad_norm(*args, **kwargs)
