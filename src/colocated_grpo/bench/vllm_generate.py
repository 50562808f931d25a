"""Standalone vLLM generation throughput: the ceiling a colocated generation phase can be compared with, and what each
request's outputs cost.

Builds one engine with the given memory share and TP size and generates fixed batches of fixed-length completions
(`ignore_eos` and `min_tokens`, so random weights cannot stop early), then prints tokens/s. Compare with a run's
`perf/gen_tokens_per_s` at the same batch and memory share.

`--engine trl` builds the engine the way TRL's colocate mode does: inside this process (external_launcher, no
engine-core process), at most 4096 batched tokens, processed log-probs. The gap between the two engines is vLLM's
cost of running in-process.

`--outputs` names what each request asks the engine to return, each timed at every `--prompts` batch size:
    none   no log-probs, text detokenized (vLLM's default request)
    trl    TRL's colocated request: the sampled token's log-prob (logprobs=0), text detokenized
    fast   the same log-probs, no text, flat log-probs (placement.fast_outputs)
Each is reported as a share of `none`, with the time the log-probs take to parse as a run parses them (TRL's
extract_logprobs; for `fast`, compat.trl.read_flat_logprobs).

`--max-num-seqs` caps the sequences the engine decodes at once, `--cudagraph-max` sets the largest batch vLLM
captures a CUDA graph for (its default stops at 512; larger decoding batches run without graphs). The JSON records
the values the engine ran with.

    python -m colocated_grpo.bench.vllm_generate --model qwen2.5-1.5b-random --prompts 64 --completion 256 --mem 0.3
    python -m colocated_grpo.bench.vllm_generate --engine trl --outputs none,trl,fast --prompts 32,128,256,512
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from statistics import fmean

import psutil

from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.compat import vllm as vllm_internals
from colocated_grpo.provenance import checkout, command_parser
from colocated_grpo.run_files import write_json

OUTPUTS = ("none", "trl", "fast")
SETTINGS = ("model", "prompt_tokens", "completion", "mem", "tp", "engine", "max_num_seqs", "cudagraph_max")


def sampling_kwargs(outputs: str) -> dict:
    """What a request asks the engine to return, per --outputs variant."""
    if outputs == "none":
        return {"logprobs": None}
    if outputs == "trl":
        return {"logprobs": 0}
    return {"logprobs": 0, **vllm_internals.fast_output_kwargs()}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _outputs_list(text: str) -> list[str]:
    names = text.split(",")
    if unknown := [n for n in names if n not in OUTPUTS]:
        raise argparse.ArgumentTypeError(f"unknown --outputs {unknown}; choose from {list(OUTPUTS)}")
    return names


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser("colocated_grpo.bench.vllm_generate", __doc__, prog)
    parser.add_argument("--model", default="qwen2.5-0.5b-random", help="a conf/model option or a model directory")
    parser.add_argument("--prompts", type=_int_list, default=[64], help="completions per batch, e.g. 32,128,512")
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
    parser.add_argument(
        "--outputs",
        type=_outputs_list,
        default=None,
        help=f"comma-separated request variants from {list(OUTPUTS)} (default: trl for --engine trl, else none)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs (default: vLLM's for this device)")
    parser.add_argument(
        "--cudagraph-max", type=int, help="vLLM's max_cudagraph_capture_size (default: vLLM's, 512 on an H200)"
    )
    parser.add_argument("--json", help="also write the settings and each repeat's tokens/s to this file")
    return parser


def main(argv=None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.outputs = args.outputs or ["trl" if args.engine == "trl" else "none"]
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
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
        **({"compilation_config": {"max_cudagraph_capture_size": args.cudagraph_max}} if args.cudagraph_max else {}),
    )
    limits = engine_limits(llm)
    print(f"engine: at most {limits['max_num_seqs']} sequences at once, CUDA graphs up to {limits['cudagraph_max']}")
    fixed = {"temperature": 1.0, "max_tokens": args.completion, "min_tokens": args.completion, "ignore_eos": True}
    results = []
    for batch in args.prompts:
        prompts = [
            {"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range(args.prompt_tokens)]} for i in range(batch)
        ]
        for outputs in args.outputs:
            params = SamplingParams(**fixed, **sampling_kwargs(outputs))
            _time(llm, prompts[:2], params, 1)  # warm-up, the parser's import included
            results.append({"prompts": batch, "outputs": outputs, **_time(llm, prompts, params, args.repeats)})
            r = results[-1]
            print(
                f"{batch} × {args.completion}, outputs {outputs}: {fmean(r['tokens_per_s']):,.0f} tokens/s "
                f"(repeats {', '.join(f'{x:,.0f}' for x in r['tokens_per_s'])}; log-prob parse "
                f"{fmean(r['parse_s']) * 1e3:.1f} ms), mem {args.mem}, TP {args.tp}",
                flush=True,
            )
    _print_shares(results)
    if args.json:
        settings = {k: getattr(args, k) for k in SETTINGS}
        settings["prompts"] = args.prompts[0] if len(args.prompts) == 1 else args.prompts
        first = results[0]["tokens_per_s"]  # the first case's repeats: what the study report reads
        report = {"settings": settings, "tokens_per_s": first, "results": results, "engine_limits": limits}
        # vLLM's default engine runs in processes of its own; TRL's colocated one in this process (none)
        report["engine_processes"] = len(psutil.Process().children(recursive=True))
        write_json(Path(args.json), report)


def _time(llm, prompts, params, repeats: int) -> dict:
    """tokens/s of each repeat, and the seconds parsing the outputs' log-probs takes (0 without log-probs): TRL's
    extract_logprobs, or read_flat_logprobs for flat ones (what a run with placement.fast_outputs uses)."""
    parser = trl_internals.read_flat_logprobs if params.flat_logprobs else trl_internals.extract_logprobs
    rates, parse = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        t0 = time.perf_counter()
        if params.logprobs is not None:
            parser(outputs)
        parse.append(time.perf_counter() - t0)
    return {"tokens_per_s": rates, "parse_s": parse}


def _print_shares(results: list[dict]) -> None:
    """Each variant's rate as a share of the no-log-prob rate at the same batch size."""
    base = {r["prompts"]: fmean(r["tokens_per_s"]) for r in results if r["outputs"] == "none"}
    for r in results:
        if r["prompts"] in base and r["outputs"] != "none":
            share = fmean(r["tokens_per_s"]) / base[r["prompts"]]
            r["share_of_none"] = share
            print(f"{r['prompts']} sequences, outputs {r['outputs']}: {share:.0%} of the no-log-prob rate")


def engine_limits(llm) -> dict:
    """What the engine was built with: the most sequences it decodes at once, the largest CUDA-graph batch (None when
    it runs eagerly)."""
    config = llm.llm_engine.vllm_config
    eager = config.model_config.enforce_eager
    return {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "cudagraph_max": None if eager else config.compilation_config.max_cudagraph_capture_size,
    }


def engine_kwargs(engine: str) -> dict:
    """LLM(...) arguments of the engine kind; "trl" mirrors trl.generation.vllm_generation's colocate engine. On CPU
    both run eagerly, as train.py's engine does there by default (placement.cpu_eager)."""
    import torch

    cpu = {} if torch.cuda.is_available() else vllm_internals.run_eagerly()
    if engine == "default":
        return cpu
    if "WORLD_SIZE" not in os.environ:  # one process of its own: the rendezvous external_launcher expects
        from colocated_grpo.launch.processes import free_port

        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    return {**trl_internals.COLOCATE_ENGINE_KWARGS, **cpu}


def resolve_model(name: str) -> str:
    """A conf/model option name (built if needed) or a path/hub id as is."""
    from hydra import compose, initialize_config_dir

    if "/" in name or Path(name).exists():  # a path or a hub id: no option of conf/model/ has a slash
        return name
    conf = checkout() / "conf"
    if not (conf / "model" / f"{name}.yaml").exists():
        return name
    from colocated_grpo.training.models import resolve

    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}"])
    return resolve(cfg.model)


if __name__ == "__main__":
    main()
