"""Standalone vLLM generation throughput: the ceiling a colocated generation phase can be compared with.

Builds one engine with the given memory share and TP size and generates a fixed batch of fixed-length completions
(`ignore_eos` and `min_tokens`, so random weights cannot stop early), then prints tokens/s. Compare with a run's
`perf/gen_tokens_per_s` at the same batch and memory share.

`--engine trl` builds the engine the way TRL's colocate mode does: inside this process (external_launcher, no
engine-core process), at most 4096 batched tokens, processed log-probs returned for every token. The gap between the
two engines is vLLM's cost of running in-process; what remains up to a run's generate phase is TRL's own work.

    python -m colocated_grpo.bench.vllm_generate --model qwen2.5-1.5b-random --prompts 64 --completion 256 --mem 0.3
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from colocated_grpo.compat import trl as trl_internals


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b-random", help="a conf/model option or a model directory")
    parser.add_argument("--prompts", type=int, default=64, help="completions per batch (the GRPO generation batch)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion", type=int, default=256, help="tokens generated per completion")
    parser.add_argument("--mem", type=float, default=0.3, help="gpu_memory_utilization")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--engine",
        choices=("default", "trl"),
        default="default",
        help="vLLM's default engine, or one built like TRL's colocated engine (see above)",
    )
    parser.add_argument("--json", help="also write the settings and each repeat's tokens/s to this file")
    args = parser.parse_args(argv)
    if args.engine == "trl" and args.tp > 1 and "WORLD_SIZE" not in os.environ:
        parser.error(
            f"--engine trl with --tp {args.tp} needs one process per GPU: torchrun --nproc_per_node={args.tp} "
            "-m colocated_grpo.bench.vllm_generate …"
        )

    from vllm import LLM, SamplingParams

    path = resolve_model(args.model)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(
        model=path,
        gpu_memory_utilization=args.mem,
        tensor_parallel_size=args.tp,
        max_model_len=args.prompt_tokens + args.completion + 8,
        seed=0,
        **engine_kwargs(args.engine),
    )
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.completion,
        min_tokens=args.completion,
        ignore_eos=True,
        logprobs=0 if args.engine == "trl" else None,
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range(args.prompt_tokens)]} for i in range(args.prompts)
    ]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rates = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(tokens / seconds)
        print(
            f"repeat {r}: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:,.0f} tokens/s "
            f"({args.prompts} × {args.completion}, mem {args.mem}, TP {args.tp})",
            flush=True,
        )
    if args.json:
        from colocated_grpo.run_files import write_json

        settings = {
            k: getattr(args, k) for k in ("model", "prompts", "prompt_tokens", "completion", "mem", "tp", "engine")
        }
        import psutil

        # vLLM's default engine runs in processes of its own; TRL's colocated one in this process (none)
        engine_processes = len(psutil.Process().children(recursive=True))
        write_json(Path(args.json), {"settings": settings, "tokens_per_s": rates, "engine_processes": engine_processes})


def engine_kwargs(engine: str) -> dict:
    """LLM(...) arguments of the engine kind; "trl" mirrors trl.generation.vllm_generation's colocate engine."""
    if engine == "default":
        return {}
    if "WORLD_SIZE" not in os.environ:  # one process of its own: the rendezvous external_launcher expects
        from colocated_grpo.launch.processes import free_port

        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    return dict(trl_internals.COLOCATE_ENGINE_KWARGS)


def resolve_model(name: str) -> str:
    """A conf/model option name (built if needed) or a path/hub id as is."""
    from hydra import compose, initialize_config_dir

    from colocated_grpo.provenance import REPO

    conf = REPO / "conf"
    if not (conf / "model" / f"{name}.yaml").exists():
        return name
    from colocated_grpo.training.models import resolve

    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}"])
    return resolve(cfg.model)


if __name__ == "__main__":
    main()
