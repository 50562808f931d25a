"""What a generation batch's training costs by how its micro-batches are made: one optimizer step of our trainer
(ColocatedGRPOTrainer: TRL's `compute_loss` and the backward for each micro-batch, as TRL's `training_step` runs them
once a generation batch is buffered) on a random-weight model of a named shape, with completion lengths drawn from a
length profile. No engine and no generation: the training side of `run.balance_micro_batches` and
`run.pack_micro_batches` alone.

    trl              TRL's micro-batches: shuffled rows, each micro-batch padded to the whole batch's longest
    balanced         run.balance_micro_batches: similar lengths together, each micro-batch cut to its own longest
    packed           run.pack_micro_batches on TRL's micro-batches: no padding computed
    packed_balanced  both: packed micro-batches of about equal tokens

Each variant's loss is the same sum over the same completion tokens (printed, to see that the work is the same); the
time is the median of --repeats after one warm-up; the padding share and the share of packed forwards are the
trainer's own (`micro_batches/padding_share`, `micro_batches/packed_share`).

    python -m colocated_grpo.bench.micro_batches --shape qwen2.5-1.5b --rows 256 --micro-batches 4 --cap 256
    python -m colocated_grpo.bench.micro_batches --shape tiny --device cpu --rows 64 --cap 256
"""

from __future__ import annotations

import math
import tempfile
import time
from statistics import median

import torch

from colocated_grpo.provenance import command_parser
from colocated_grpo.run_files import write_json
from colocated_grpo.training import lengths, micro_batches, models

VARIANTS = ("trl", "balanced", "packed", "packed_balanced")
SHARES = ("padding_share", "packed_share")  # the trainer's own counts, a median over the step's forwards


def build_parser(prog: str | None = None):
    parser = command_parser("colocated_grpo.bench.micro_batches", __doc__, prog)
    parser.add_argument("--shape", default="tiny", choices=sorted(models.SHAPES), help="a random-weight Qwen2 shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64, help="completions in one optimizer step (one rank)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches they train in")
    parser.add_argument("--prompt", type=int, default=64, help="the longest prompt; prompts run from half of it")
    parser.add_argument("--cap", type=int, default=256, help="max_completion_length")
    parser.add_argument("--profile", default="realistic", choices=sorted(lengths.PROFILES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing, as TRL's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the settings and each variant's times to this file")
    return parser


def completion_lengths(profile: str, cap: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Lengths as the profile makes them (training/lengths.py): its floor, then EOS with the same chance at each
    token, cut at the cap."""
    floor, chance = lengths.floor_and_chance(profile, cap)
    uniform = torch.rand(rows, generator=generator, dtype=torch.float64)
    after = torch.ceil(torch.log1p(-uniform) / math.log1p(-chance)).clamp(min=1)
    return (floor + after).clamp(max=cap).long()


def generation_batch(args, vocab: int) -> list[dict]:
    """TRL's buffered micro-batches of one optimizer step: prompts padded on the left and completions on the right to
    the longest of the whole batch, rows in random order, the generation batch's completion tokens beside them."""
    generator = torch.Generator().manual_seed(args.seed)
    completion = completion_lengths(args.profile, args.cap, args.rows, generator)
    prompt = torch.randint(args.prompt // 2, args.prompt + 1, (args.rows,), generator=generator)
    prompt_mask = (torch.arange(int(prompt.max())) >= int(prompt.max()) - prompt[:, None]).long()
    completion_mask = (torch.arange(int(completion.max())) < completion[:, None]).long()
    batch = {
        "prompt_ids": torch.randint(1, vocab, prompt_mask.shape, generator=generator) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(1, vocab, completion_mask.shape, generator=generator) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(args.rows, generator=generator),
    }
    rows = args.rows // args.micro_batches
    micro = [{key: value[k * rows : (k + 1) * rows] for key, value in batch.items()} for k in range(args.micro_batches)]
    return [{**batch, "num_items_in_batch": completion_mask.sum()} for batch in micro]


def build_trainer(args, out_dir: str):
    """Our trainer as train.py builds it, without an engine: a random-weight model of the shape, packing ready (each
    variant turns it on or off), TRL's loss at its defaults."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig

    from colocated_grpo.training.trainer import ColocatedGRPOTrainer

    cuda = args.device.startswith("cuda")
    shape = models.SHAPES[args.shape]
    config = Qwen2Config(
        vocab_size=shape.vocab_size or models.TOKENIZER_VOCAB, **shape.dimensions(), attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    trainer_args = GRPOConfig(
        output_dir=out_dir,
        use_vllm=False,
        use_cpu=not cuda,
        bf16=cuda,
        per_device_train_batch_size=args.rows // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches,
        num_generations=2,
        max_completion_length=args.cap,
        gradient_checkpointing=args.checkpointing,
        report_to=[],
        save_strategy="no",
    )
    trainer = ColocatedGRPOTrainer(
        model=model,
        processing_class=models.build_tokenizer(config.vocab_size),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=trainer_args,
        train_dataset=Dataset.from_dict({"prompt": ["1 + 1 ="] * args.rows}),
        pack_micro_batches=True,
    )
    trainer.current_gradient_accumulation_steps = args.micro_batches  # set by transformers' loop, which this skips
    return trainer


def train_step(trainer, micro: list[dict], packed: bool) -> float:
    """TRL's training step on buffered micro-batches: `compute_loss` and the backward of each; the loss summed."""
    trainer.pack_micro_batches = packed
    trainer.model.train()
    total = 0.0
    for batch in micro:
        loss = trainer.compute_loss(trainer.model, batch)
        trainer.accelerator.backward(loss)
        total += loss.item()
    return total


def main(argv=None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.rows % args.micro_batches:
        parser.error(f"--rows {args.rows} is not a multiple of --micro-batches {args.micro_batches}")
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trainer(args, out_dir)
    model = trainer.model
    dtype = next(model.parameters()).dtype
    trl_micro = [
        {key: value.to(model.device) for key, value in batch.items()}
        for batch in generation_batch(args, model.config.vocab_size)
    ]
    tokens = int(trl_micro[0]["num_items_in_batch"])
    made = {
        "trl": (trl_micro, False),
        "balanced": (micro_batches.regroup(trl_micro, args.micro_batches, packed=False), False),
        "packed": (trl_micro, True),
        "packed_balanced": (micro_batches.regroup(trl_micro, args.micro_batches, packed=True), True),
    }
    print(
        f"{args.shape} on {args.device} ({dtype}): {args.rows} completions in {args.micro_batches} micro-batches, "
        f"prompts of {args.prompt // 2}-{args.prompt} tokens, completions at the {args.profile} profile of {args.cap} "
        f"(mean {tokens / args.rows:.0f})"
    )
    results = {}
    for name in VARIANTS:
        micro, packed = made[name]
        seconds = []
        for _ in range(args.repeats + 1):  # the first: warm-up
            model.zero_grad(set_to_none=True)
            trainer._metrics["train"].clear()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = train_step(trainer, micro, packed)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        counted = {key: median(trainer._metrics["train"][f"micro_batches/{key}"]) for key in SHARES}
        taken = median(seconds[1:])
        results[name] = {"seconds": seconds[1:], "median_s": taken, "loss": loss, "peak_gib": peak, **counted}
        memory = f", peak {peak:.1f} GiB" if peak is not None else ""
        print(
            f"  {name:16s} {taken:8.3f} s  ({results['trl']['median_s'] / taken:.2f}x of trl)  "
            f"padding {counted['padding_share']:6.1%}  packed {counted['packed_share']:4.0%}  loss {loss:+.6f}{memory}"
        )
    if args.json:
        write_json(args.json, {"settings": vars(args), "dtype": str(dtype), "tokens": tokens, "variants": results})


if __name__ == "__main__":
    main()
