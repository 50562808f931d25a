"""Phase attribution and aggregation on recorded sample streams (the real code, synthetic input)."""

import itertools
import math
import time
import types

import pytest

from colocated_grpo.telemetry import nvml
from colocated_grpo.telemetry.aggregate import RankReport, SteadyState, label_samples, step_metrics
from colocated_grpo.telemetry.callback import format_line
from colocated_grpo.telemetry.nvml import Sample
from colocated_grpo.telemetry.phases import PhaseTracker, StepPhases


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def recorded_step(offset=0.0):
    """A step of 10 s: other 1, generate 4 (sync_weights 1 inside), reward 1, train 3, other 1."""
    clock = FakeClock()
    clock.t = offset
    tracker = PhaseTracker(clock=clock)
    tracker.begin_step()
    clock.t += 1  # loop overhead: other
    with tracker.phase("train"):  # TRL's training_step
        with tracker.phase("generate"):
            clock.t += 1
            with tracker.phase("sync_weights"):
                clock.t += 1
            clock.t += 2
        with tracker.phase("reward"):
            clock.t += 1
        clock.t += 2  # forward + backward
    tracker.enter("train")  # optimizer step via callback edges
    clock.t += 1
    tracker.exit("train")
    clock.t += 1
    return tracker.end_step()


def test_nested_phases_go_to_the_innermost_and_add_up_to_the_step():
    step = recorded_step()
    d = step.durations()
    assert step.duration == 10
    assert d == {"generate": 3, "sync_weights": 1, "sleep_wake": 0, "reward": 1, "train": 3, "other": 2}
    assert sum(d.values()) == pytest.approx(step.duration)
    # segments tile the step without gaps or overlaps
    assert step.segments[0].start == step.start and step.segments[-1].end == step.end
    assert all(a.end == b.start for a, b in itertools.pairwise(step.segments))


def test_trls_generation_weight_sync_and_sleep_mode_engine_calls_are_timed_in_their_phases(monkeypatch):
    """TimedGRPOTrainer times TRL's _generate, its engine wrapper's sync_weights inside it, and the colocated engine's
    sleep/wake_up (sleep mode only), whose time leaves generate; generated tokens are counted."""
    from types import SimpleNamespace

    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    from colocated_grpo.compat.grpo_trainer import TimedGRPOTrainer, TimedVLLMGeneration
    from colocated_grpo.telemetry.phases import TokenCounter

    clock = FakeClock()

    def advance(seconds, result=None):
        def call(*args, **kwargs):
            clock.t += seconds
            return result

        return call

    def generate(self, prompts):  # TRL's _generate, as far as the engine goes
        self.vllm_generation.sync_weights()
        self.vllm_generation.llm.wake_up(tags=["kv_cache"])
        clock.t += 2
        self.vllm_generation.llm.sleep(level=2)
        return [[1, 2]], [[3, 4, 5]]

    monkeypatch.setattr(GRPOTrainer, "_generate", generate)
    monkeypatch.setattr(VLLMGeneration, "sync_weights", advance(1))

    def trainer(sleep_mode: bool, llm):
        built = TimedGRPOTrainer.__new__(TimedGRPOTrainer)  # no model, no engine: the timing overrides alone
        built.vllm_generation = TimedVLLMGeneration.__new__(TimedVLLMGeneration)
        built.vllm_generation.llm, built.vllm_generation.enable_sleep_mode = llm, sleep_mode
        return built

    llm = SimpleNamespace(sleep=advance(0.5), wake_up=advance(0.25))
    asleep = trainer(True, llm)
    tracker, tokens = PhaseTracker(clock=clock), TokenCounter()
    asleep.time_phases(tracker, tokens)
    tracker.begin_step()
    asleep._generate(["a prompt"])
    d = tracker.end_step().durations()
    assert (d["generate"], d["sync_weights"], d["sleep_wake"]) == (2, 1, 0.75)
    assert tokens.reset() == (2, 3)

    awake = SimpleNamespace(sleep=llm.sleep, wake_up=llm.wake_up)
    trainer(False, awake).time_phases(tracker, tokens)
    assert awake.sleep is llm.sleep  # sleep mode off: the engine is left alone


def test_a_trl_without_a_timed_method_is_said_at_start(monkeypatch, caplog):
    """Another TRL that renamed a method the timings override: the run says which phases read 0."""
    from trl import GRPOTrainer

    from colocated_grpo.compat.grpo_trainer import TimedGRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self: None)  # no model, no engine
    TimedGRPOTrainer()
    assert not caplog.records
    monkeypatch.delattr(GRPOTrainer, "_calculate_rewards")
    TimedGRPOTrainer()
    [record] = caplog.records
    assert record.levelname == "WARNING" and "has no _calculate_rewards; those phases read 0" in record.getMessage()


def test_barrier_runs_at_every_edge_and_its_cost_is_counted():
    calls = []
    clock = FakeClock()

    def barrier():
        calls.append(clock.t)
        clock.t += 0.5

    tracker = PhaseTracker(clock=clock, barrier=barrier)
    tracker.begin_step()
    with tracker.phase("generate"):
        clock.t += 1
    step = tracker.end_step()
    assert len(calls) == 4 and tracker.barrier_s == 2.0
    assert step.durations()["generate"] == 1.5  # the wait for queued work is charged to the phase that queued it


def test_unknown_phase_is_rejected():
    with pytest.raises(ValueError, match="unknown phase"):
        PhaseTracker().enter("backward")


def stream(gpu, start, end, util_by_second, mem=10.0):
    """Samples every 0.5 s; util_by_second maps whole seconds since start to a utilisation."""
    out, t = [], start + 0.25
    while t < end:
        out.append(
            Sample(
                t=t,
                gpu=gpu,
                util=util_by_second[int(t - start)],
                mem_gb=mem + (t - start),
                power_w=300.0,
                sm_clock_mhz=1980.0,
            )
        )
        t += 0.5
    return out


# per second of the recorded step: other, gen, sync, gen, gen, reward, train, train, train(opt), other
UTIL = [0, 90, 40, 90, 90, 0, 60, 60, 60, 0]


def test_samples_are_labelled_with_the_phase_running_at_their_time():
    step = recorded_step()
    labelled = label_samples(stream("0", 0, 10, UTIL), step.segments)
    phases = [p for _, p in labelled]
    assert phases[:2] == ["other", "other"] and phases[2:4] == ["generate", "generate"]
    assert phases[4:6] == ["sync_weights", "sync_weights"] and phases[10:12] == ["reward", "reward"]
    assert len(labelled) == 20
    # samples outside the step are dropped
    assert label_samples([Sample(11.0, "0", 1, 1, 1, 1)], step.segments) == []


def test_step_metrics_aggregate_two_ranks():
    reports = [
        RankReport(0, recorded_step(), stream("0", 0, 10, UTIL, mem=10), prompt_tokens=1000, completion_tokens=3000),
        RankReport(1, recorded_step(), stream("1", 0, 10, [u / 2 for u in UTIL], mem=20), 1000, 3000),
    ]
    m = step_metrics(reports, n_params=1_000_000, peak_tflops_per_gpu=1.0)
    assert m["timing_s/step"] == 10 and m["timing_s/generate"] == 3 and m["timing_s/other"] == 2
    assert m["perf/tokens_per_s"] == 800 and m["perf/tokens_per_s_per_gpu"] == 400
    assert m["perf/tokens_per_s_per_train_gpu"] == 400 and m["placement/gpus"] == 2
    assert m["perf/gen_tokens_per_s"] == 2000
    assert m["perf/mfu"] == pytest.approx(6 * 1e6 * 8000 / (10 * 1e12 * 2))
    assert m["perf/train_mfu"] == pytest.approx(6 * 1e6 * 8000 / (m["timing_s/train"] * 1e12 * 2))
    assert m["gpu/util_generate"] == pytest.approx((90 + 45) / 2)
    assert m["gpu/util_sync_weights"] == pytest.approx((40 + 20) / 2)
    assert m["gpu/util_reward"] == 0 and m["gpu/util_train"] == pytest.approx(45)
    assert m["gpu/0/util"] == pytest.approx(sum(UTIL) / 10) and m["gpu/1/util"] == pytest.approx(sum(UTIL) / 20)
    assert m["gpu/idle_frac"] == pytest.approx(12 / 40)  # util 0 in 3 of 10 seconds on both GPUs
    assert m["memory/peak_gb"] == pytest.approx(20 + 9.75)
    assert m["gpu/0/power_w"] == 300 and m["gpu/samples"] == 40


def test_step_line_shows_reward_time_throughput_and_gpu_util_of_the_step():
    reports = [
        RankReport(0, recorded_step(), stream("0", 0, 10, UTIL, mem=10), prompt_tokens=1000, completion_tokens=3000),
        RankReport(1, recorded_step(), stream("1", 0, 10, [u / 2 for u in UTIL], mem=20), 1000, 3000),
    ]
    m = {"reward": 0.4123, "loss": 0.1, **step_metrics(reports)}
    util = (m["gpu/0/util"] + m["gpu/1/util"]) / 2  # the mean over GPUs, not a phase's (gpu/util_train)
    assert (
        format_line(2, 3, m)
        == f"step 2/3 | reward 0.412 | 10.00 s (generate 3.00, train 3.00) | 400 tok/s/GPU | GPU {util:.0f} %"
    )
    # on a CPU (no NVML) no GPU part; with telemetry off, TRL's own step time; before any reward, none
    cpu = step_metrics([RankReport(0, recorded_step(), [], 10, 30)])
    assert (
        format_line(1, 3, {"reward": 0.0, **cpu})
        == "step 1/3 | reward 0 | 10.00 s (generate 3.00, train 3.00) | 4 tok/s/GPU"
    )
    assert format_line(5, -1, {"step_time": 1.234}) == "step 5 | 1.23 s"
    # placement.overlap: the step's batch, generated while the step before trained: beside its phases, not in them
    ahead = {
        "timing_s/step": 0.7,
        "timing_s/generate": 0.01,
        "timing_s/train": 0.6,
        "timing_s/generate_overlapped": 0.5,
    }
    assert format_line(3, 3, ahead) == (
        "step 3/3 | 0.70 s (generate 0.01, train 0.60; its batch generated ahead in 0.50)"
    )


def test_server_gpus_count_as_used_but_not_as_training_gpus():
    # server placement: rank 0 also samples the server's GPU; it is busy while the trainer generates
    server = stream("server0", 0, 10, [0, 95, 0, 95, 95, 0, 0, 0, 0, 0])
    reports = [RankReport(0, recorded_step(), stream("0", 0, 10, UTIL) + server, 1000, 3000)]
    m = step_metrics(reports)
    assert m["placement/gpus"] == 2
    assert m["perf/tokens_per_s_per_gpu"] == 200 and m["perf/tokens_per_s_per_train_gpu"] == 400
    assert m["gpu/server0/util"] == pytest.approx(28.5)
    assert m["gpu/util_generate"] == pytest.approx((90 + 95) / 2)


def test_without_gpus_timings_and_throughput_remain():
    m = step_metrics([RankReport(0, recorded_step(), [], 10, 30)])
    assert m["perf/tokens_per_s"] == 4 and "perf/mfu" not in m
    assert not any(k.startswith(("gpu/", "memory/")) for k in m)


def steady_state(records: list[dict], warmup_steps: int, starts=(0,)) -> dict[str, float]:
    state = SteadyState(warmup_steps, starts)
    for record in records:
        state.add(record)
    return state.summary()


def test_steady_state_excludes_warmup_and_keeps_final_reward():
    records = [
        {"train/global_step": 1, "timing_s/step": 30.0, "reward": 0.1},
        {"train/global_step": 2, "timing_s/step": 2.0, "reward": 0.2},
        {"train/global_step": 3, "timing_s/step": 4.0, "reward": 0.6, "note": "text"},
    ]
    s = steady_state(records, warmup_steps=1)
    assert s["timing_s/step"] == 3.0 and s["reward"] == pytest.approx(0.4) and s["final/reward"] == 0.6
    assert s["steady_state/steps"] == 2 and "note" not in s
    assert steady_state(records[:1], warmup_steps=5)["timing_s/step"] == 30.0  # too short: all steps


def test_steady_state_of_a_resumed_run_leaves_out_each_attempts_warm_up():
    """Resumed from step 3: step 4 starts a fresh engine, a warm-up like step 1."""
    records = [{"train/global_step": n, "timing_s/step": t} for n, t in enumerate([30.0, 2.0, 4.0, 20.0, 6.0], 1)]
    s = steady_state(records, warmup_steps=1, starts=(0, 3))
    assert s["timing_s/step"] == 4.0 and s["steady_state/steps"] == 3 and s["steady_state/attempts"] == 2
    one = steady_state(records, warmup_steps=1)
    assert one["steady_state/steps"] == 4 and one["steady_state/attempts"] == 1
    # too short to leave out a warm-up: every step, of both attempts
    s = steady_state([records[0], records[3]], warmup_steps=1, starts=(0, 3))
    assert s["timing_s/step"] == 25.0 and s["steady_state/steps"] == 2 and s["steady_state/attempts"] == 2


def reused_step():
    """A step of trainer.num_iterations=2 that trains on the previous step's generation: 2 s of training only."""
    clock = FakeClock()
    tracker = PhaseTracker(clock=clock)
    tracker.begin_step()
    with tracker.phase("train"):
        clock.t += 2
    return tracker.end_step()


def test_a_step_that_reuses_a_generation_shows_no_rate_and_the_summary_keeps_the_final_reward(tmp_path):
    from colocated_grpo import run_files
    from colocated_grpo.launch.lifecycle import end_of_run_summary

    generated = step_metrics([RankReport(0, recorded_step(), [], 10, 30)])  # 4 tokens/s
    reused = step_metrics([RankReport(0, reused_step(), [], 0, 0)])
    assert reused["perf/tokens"] == 0 and not [k for k in reused if k.startswith("perf/tokens_per_s")]
    assert format_line(2, 4, reused) == "step 2/4 | 2.00 s (generate 0.00, train 2.00) | generation reused"
    # TRL logs a reward for the steps that generate only
    steps = [(generated, {"reward": 0.1}), (reused, {}), (generated, {"reward": 0.3}), (reused, {})]
    summary = steady_state([{"train/global_step": n, **m, **r} for n, (m, r) in enumerate(steps, 1)], 0)
    assert summary["final/reward"] == 0.3 and summary["perf/tokens_per_s_per_gpu"] == 4, "reuse steps not counted"
    run_files.write_json(tmp_path / run_files.SUMMARY, summary)
    lines = end_of_run_summary(tmp_path).splitlines()
    assert "  tokens/s per GPU 4" in lines and "  final reward 0.3" in lines


def test_a_step_logs_the_median_and_p99_of_every_ranks_completion_lengths():
    """Completions counted one by one (TokenCounter.count) keep their lengths; the step's completions/p50_length and
    completions/p99_length are the nearest-rank percentiles over every rank's completions, beside TRL's mean, min, max
    and share at the cap. A step that counted no completion one by one has neither."""
    from colocated_grpo.telemetry.phases import TokenCounter

    tokens = TokenCounter()
    tokens.count([[1, 2], [1]], [[0] * 3, [0] * 5])
    tokens.count([[1]], [[0] * 4])
    assert tokens.lengths == [3, 5, 4]
    assert tokens.reset() == (4, 12) and tokens.lengths == []
    ranks = [list(range(100, 0, -2)), list(range(99, 0, -2))]  # every length from 1 to 100, half on each rank
    m = step_metrics([RankReport(r, recorded_step(), [], 10, 30, lengths) for r, lengths in enumerate(ranks)])
    assert (m["completions/p50_length"], m["completions/p99_length"]) == (50, 99)
    one = step_metrics([RankReport(0, recorded_step(), [], 10, 30, [7, 256, 9])])
    assert (one["completions/p50_length"], one["completions/p99_length"]) == (9, 256)
    assert not [k for k in step_metrics([RankReport(0, recorded_step(), [], 10, 30)]) if k.startswith("completions/")]


def test_empty_step_has_nan_not_crash():
    m = step_metrics([RankReport(0, StepPhases(0.0, 0.0), [], 0, 0)])
    assert m["timing_s/step"] == 0 and "perf/tokens_per_s" not in m
    assert not math.isnan(m["timing_s/generate"])


# Why there are no GPU metrics. NVML cannot work on a CPU machine, so pynvml is made to fail in each way it can.
def _nvml_init_raises(monkeypatch, code):
    import pynvml

    def init():
        raise pynvml.NVMLError(code)  # pynvml's own subclass for the code, as the real library raises it

    monkeypatch.setattr(pynvml, "nvmlInit", init)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (
            "NVML_ERROR_LIBRARY_NOT_FOUND",
            "libnvidia-ml.so not found (no NVIDIA driver, or not on the library path) "
            "(NVMLError: NVML Shared Library Not Found)",
        ),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "the NVIDIA driver is not loaded (NVMLError: Driver Not Loaded)"),
        ("NVML_ERROR_NO_PERMISSION", "no permission to open the GPUs (NVMLError: Insufficient Permissions)"),
        ("NVML_ERROR_UNKNOWN", "NVML failed: Unknown Error"),
    ],
)
def test_nvml_unavailable_says_what_failed(monkeypatch, code, said):
    import pynvml

    _nvml_init_raises(monkeypatch, getattr(pynvml, code))
    assert nvml.unavailable() == said


def test_nvml_unavailable_without_pynvml_or_gpus_and_none_with_gpus(monkeypatch):
    import sys

    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    assert nvml.unavailable() == "NVML sees no GPU (0 devices)"
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    assert nvml.unavailable() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if not installed: `import pynvml` raises ImportError
    assert nvml.unavailable() == "pynvml is not installed (pip install nvidia-ml-py)"


def test_a_profiled_phase_counts_overlapping_kernels_once_and_the_gpus_waits_for_the_host():
    """Kernels on two streams that overlap are GPU time once; a gap over a millisecond between kernels is a wait."""
    from colocated_grpo.telemetry import profile

    busy, gaps = profile._merged_us([(0, 10), (5, 20), (3000, 3010), (3005, 3020), (5000, 5001), (5500, 5600)])
    assert busy == 20 + 20 + 1 + 100 and gaps == [2980, 1980]
    text = profile.report(
        4,
        {
            "generate": {"wall_us": 8000.0, "cpu_us": 900.0, "device_us": busy, "idle_gaps_us": gaps,
                         "ops": {"aten::mm": [2, 0.0, 120.0], "cudaGraphLaunch": [3, 900.0, 0.0]}},
        },
    )  # fmt: skip
    assert "phase generate: wall 8.0 ms, host ops 0.9 ms, GPU busy 0.1 ms (2 % of its wall time)" in text
    assert "GPU idle between kernels 2 times over 1 ms (median 3.0 ms, 5.0 ms in all)" in text
    assert text.index("aten::mm") < text.index("cudaGraphLaunch"), "kernels by GPU time, then host ops by host time"


class FlakyNvml:
    """pynvml's reads for one GPU, raising pynvml's own error at the reads listed in `fail_at` (1-based)."""

    def __init__(self, pynvml, fail_at):
        self.pynvml, self.fail_at, self.reads = pynvml, set(fail_at), 0

    def util(self, handle):
        self.reads += 1
        if self.reads in self.fail_at:
            raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_UNKNOWN)
        return types.SimpleNamespace(gpu=50 + self.reads)


def _sampler_on(monkeypatch, flaky) -> nvml.GpuSampler:
    import pynvml

    for name, value in {
        "nvmlInit": lambda: None,
        "nvmlDeviceGetHandleByUUID": lambda uuid: uuid,
        "nvmlDeviceGetUtilizationRates": flaky.util,
        "nvmlDeviceGetPowerUsage": lambda h: 300_000,
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=2e9),
        "nvmlDeviceGetClockInfo": lambda h, clock: 1980,
    }.items():
        monkeypatch.setattr(pynvml, name, value)
    return nvml.GpuSampler({"0": "GPU-test"}, interval_s=0.005).start()


def test_nvml_sampler_skips_a_transient_error_and_stops_only_when_the_gpu_keeps_failing(monkeypatch, caplog):
    import pynvml

    flaky = FlakyNvml(pynvml, fail_at=[2, 3])
    sampler = _sampler_on(monkeypatch, flaky)
    deadline = time.monotonic() + 10
    while flaky.reads < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    sampler.stop()
    utils = [s.util for s in sampler.take(0, time.perf_counter())]
    assert utils[:3] == [51, 54, 55], "the samples of the two failed reads are missing, the next ones are there"
    assert "GPU sampling: Unknown Error (skipped)" in caplog.text

    lost = FlakyNvml(pynvml, fail_at=range(3, 1000))
    sampler = _sampler_on(monkeypatch, lost)
    sampler._thread.join(timeout=10)
    assert not sampler._thread.is_alive() and lost.reads == 2 + nvml.GIVE_UP_AFTER
    assert [s.util for s in sampler.take(0, time.perf_counter())] == [51, 52]
    assert "GPU sampling: Unknown Error (stopped)" in caplog.text
