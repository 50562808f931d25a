"""Predict which placement runs a GRPO step fastest on N GPUs, from a calibration measured on one GPU.

    python -m colocated_grpo.bench.placement measure sweeps/studies/calibration_h200.yaml --dir DIR --out my_gpu.json
    python -m colocated_grpo.bench.placement calibrate sweeps/results/calibration_h200 \
        --study sweeps/studies/calibration_h200.yaml --out calibration.json
    python -m colocated_grpo.bench.placement predict --calibration calibration.json --gpus 8 \
        --completions 1024 --prompt-tokens 150 --completion-tokens 1024 --model-params 1.5
    python -m colocated_grpo.bench.placement validate --calibration FILE sweeps/results/h200_x2 … --out DIR

`measure` runs a study's calibration subset on this machine's GPU and writes the small calibration file (your GPU's,
to share); `calibrate` writes it from study directories already run (`--study` or `--only` picks the subset, the
rest is held out for `validate`); `predict` prints the placements ranked by predicted step time and writes a figure;
`validate` predicts every measured job of study or sweep directories and tables the errors; `scaling` draws one
GPU's step over batch and completion length, predicted and measured.
The model: docs/placement.md.
"""

from __future__ import annotations

from pathlib import Path

from colocated_grpo.analysis.notebook import FIGURES, require_extra
from colocated_grpo.bench.placement import calibration, figures, validation
from colocated_grpo.bench.placement.model import Workload, placements, predict, same_size
from colocated_grpo.bench.study import definition, running
from colocated_grpo.provenance import command_parser
from colocated_grpo.run_files import write_json
from colocated_grpo.telemetry.phases import PHASES


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = command_parser("colocated_grpo.bench.placement", __doc__, prog)
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="build a calibration file from one-GPU study directories")
    cal.add_argument("directories", nargs="+", help="study (or sweep) directories; multi-GPU jobs are left out")
    subset = cal.add_mutually_exclusive_group()
    subset.add_argument(
        "--only",
        nargs="+",
        help="calibrate from the jobs and benchmarks whose MODEL/CASE matches one of these shell patterns "
        "(e.g. '*/fast_b128_l256'); the rest is held out for validate",
    )
    subset.add_argument("--study", help="a study definition: calibrate from the cases its `calibrate` key names")
    cal.add_argument("--out", required=True, help="the calibration file to write (JSON)")
    mea = sub.add_parser("measure", help="run a study's calibration subset on this GPU, then calibrate from it")
    mea.add_argument("study", help="a study definition with a `calibrate` key (sweeps/studies/calibration_h200.yaml)")
    mea.add_argument("--dir", required=True, help="the study directory the runs go to (run again to continue)")
    mea.add_argument("--out", required=True, help="the calibration file to write (JSON)")
    pre = sub.add_parser("predict", help="rank the placements for N GPUs and a workload")
    pre.add_argument("--calibration", required=True)
    pre.add_argument("--gpus", type=int, required=True)
    pre.add_argument("--completions", type=int, required=True, help="completions per step, all GPUs together")
    pre.add_argument("--prompt-tokens", type=float, required=True)
    pre.add_argument("--completion-tokens", type=float, required=True)
    pre.add_argument("--model-params", type=float, required=True, help="parameters, in billions (1.5 for 1.5B)")
    pre.add_argument("--request", choices=("fast", "trl"), default="fast", help="colocated request and sync")
    pre.add_argument("--figure", help="write the ranking figure here (PNG)")
    val = sub.add_parser("validate", help="predict every measured job of study/sweep directories, table the errors")
    val.add_argument("--calibration", required=True)
    val.add_argument("directories", nargs="+")
    val.add_argument("--out", help="write validation.md, validation.csv and validation.png into this directory")
    sca = sub.add_parser("scaling", help="one GPU's step over batch and completion length, predicted and measured")
    sca.add_argument("--calibration", required=True)
    sca.add_argument("--model-params", type=float, required=True, help="parameters, in billions (1.5 for 1.5B)")
    sca.add_argument("--prompt-tokens", type=float, default=61.0)
    sca.add_argument("directories", nargs="*", help="study/sweep directories whose one-GPU jobs of this size to show")
    sca.add_argument("--out", required=True, help="the figure to write (PNG)")
    args = parser.parse_args(argv)

    if args.command == "calibrate":
        only = _subset(args.study) if args.study else args.only
        write_json(Path(args.out), calibration.build(args.directories, only))
        print(Path(args.out))
    elif args.command == "measure":
        only = _subset(args.study)
        running.run(args.study, args.dir, only)
        write_json(Path(args.out), calibration.build([args.dir], only))
        print(Path(args.out))
    elif args.command == "predict":
        if args.figure:
            require_extra("notebooks", FIGURES, "placement predict --figure")
        _predict(args)
    elif args.command == "scaling":
        require_extra("notebooks", FIGURES, "placement scaling")
        _scaling(args)
    else:
        if args.out:
            require_extra("notebooks", FIGURES, "placement validate --out")
        _validate(args)


def _subset(study_file: str) -> list[str]:
    """The MODEL/CASE patterns a study definition's `calibrate` key names."""
    if not (patterns := definition.load(study_file).get("calibrate")):
        raise SystemExit(f"{study_file}: no `calibrate` key naming the cases to calibrate from")
    return patterns


def _predict(args) -> None:
    cal = calibration.load(args.calibration)
    workload = Workload(args.completions, args.prompt_tokens, args.completion_tokens, args.model_params)
    found = [predict(cal, workload, p) for p in placements(args.gpus, args.request)]
    found.sort(key=lambda p: (not p.fits, p.step_s))  # fastest first, those that do not fit last
    best = found[0].step_s
    title = (
        f"{args.gpus} GPUs, {args.model_params} B, {args.completions} completions × {args.completion_tokens:.0f} "
        f"tokens (prompt {args.prompt_tokens:.0f}); calibration: {cal['gpu']['name']}"
    )
    error = validation.committed(args.gpus)
    print(title)
    print(
        f"{'placement':<38} {'step s':>7} {'± s':>6} {'vs best':>8} {'tok/s/GPU':>10}  "
        + " ".join(f"{p[:8]:>8}" for p in PHASES)
    )
    for p in found:
        print(
            f"{p.placement.name:<38} {p.step_s:7.2f} {p.step_s * error['median']:6.2f} {p.step_s / best:7.2f}× "
            f"{p.tokens_per_s_per_gpu(workload):10,.0f}  " + " ".join(f"{p.phases[k]:8.2f}" for k in PHASES)
        )
    print(
        f"± s: the step time × the model's median |error| on the {error['cases']} H200 jobs "
        f"{'on one GPU' if args.gpus == 1 else 'on several GPUs'} it was not calibrated from: "
        f"{error['median']:.1%} (max {error['max']:.1%}; sweeps/results/placement_model/validation.md)"
    )
    for p in found:
        for flag in dict.fromkeys(p.flags):
            print(f"  {p.placement.name}: {flag}")
    if args.figure:
        figures.ranking(found, workload, title).savefig(args.figure, dpi=120)
        print(args.figure)


def _scaling(args) -> None:
    """Print one GPU's predicted step (and the measured one where a job of that workload ran); write the figure."""
    cal = calibration.load(args.calibration)
    predicted = figures.scaling_predictions(cal, args.model_params, args.prompt_tokens)
    this_size = [
        r
        for r in validation.rows(cal, args.directories)
        if "error" in r and r["request"] == "fast" and r["one_forward"] and same_size(r["params_b"], args.model_params)
    ]
    print(f"{'placement':<16} {'length':>6} {'batch':>6} {'step s':>7} {'tok/s/GPU':>10}  share  measured step s")
    for (kind, length), line in predicted.items():
        for work, p in line:
            seen = [
                r["measured_s"]
                for r in this_size
                if r["completions"] == work.completions
                and r["placement"] == kind
                and figures.nearest_length(r["completion_tokens"]) == length
            ]
            print(
                f"{kind:<16} {length:>6} {work.completions:>6} {p.step_s:7.2f} {p.tokens_per_s_per_gpu(work):10,.0f}"
                f"  {p.placement.mem:5.2f}  {', '.join(f'{s:.2f}' for s in seen)}"
            )
    title = f"one GPU, {args.model_params} B, prompt {args.prompt_tokens:.0f} tokens; calibration: {cal['gpu']['name']}"
    figures.scaling(predicted, this_size, title).savefig(args.out, dpi=120)
    print(args.out)


def _validate(args) -> None:
    cal = calibration.load(args.calibration)
    table = validation.rows(cal, args.directories)
    command = " ".join(["python -m colocated_grpo.bench.placement validate --calibration", args.calibration])
    command += " " + " ".join(args.directories) + (f" --out {args.out}" if args.out else "")
    text = (
        "# Placement model: predicted against measured step times\n\n"
        f"```\n{command}\n```\n\n"
        "Error = predicted / measured − 1; phases in seconds, measured → predicted; in-sample: the job's runs are "
        "among the calibration's sources. The model: docs/placement.md.\n\n" + validation.markdown(table)
    )
    print(text)
    if args.out:
        import pandas as pd

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.md").write_text(text)
        pd.DataFrame(table).to_csv(out / "validation.csv", index=False, float_format="%.4g")
        figures.validation(table).savefig(out / "validation.png", dpi=120)
        for name in ("validation.md", "validation.csv", "validation.png"):
            print(out / name)


if __name__ == "__main__":
    main()
