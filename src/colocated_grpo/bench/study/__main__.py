"""A benchmark study: named cases run for each model through the sweep launcher, each case `repeats` times with the
cases interleaved (A B A B …), plus standalone vLLM generation, into one directory; then a results table (CSV and
Markdown: per case the mean over its repeats and their spread, each speed-up from repeat k against repeat k of its
baseline, the environment and the exact commands) and a figure. The definition is a YAML file in sweeps/studies/
(see h200_x2.yaml for the keys; plain_trl_h200.yaml for repeats, warmup_steps and the plain_trl kind of case).

    python -m colocated_grpo.bench.study run sweeps/studies/h200_x2.yaml --out sweeps/results/h200_x2
    python -m colocated_grpo.bench.study report sweeps/results/h200_x2

`run` skips repeats whose job already finished, so running it again after an interruption continues the study;
`--only MODEL/CASE …` runs only the steps that match (shell patterns; MODEL/CASE/rep<k> for one repeat), e.g. the runs
a study still lacks, or one repeat of some cases at a sitting (sweeps/studies/h200_plan.sh). A study kept with the
code (`--out` under sweeps/results/) runs from a committed tree only: `--trial` runs it anyway, and its report marks
every run of it. `plan` prints the steps `run` would take and their commands, without running any (with `--out`,
those finished are kept).

    python -m colocated_grpo.bench.study plan sweeps/studies/h200_x2.yaml --out sweeps/results/h200_x2

    OUT/study.yaml                    the definition as run
    OUT/env.json                      per `run`: date, host, commit and uncommitted changes (their hash), CPU,
                                      GPUs, driver, package versions, the host's load average during each step
    OUT/runs/<model>/<case>/          the case's sweep: sweep_rep<k>.log, summary.csv, rep<k>/ (job.json, run files)
    OUT/bench/<model>/<name>.json     standalone generation: tokens/s per repeat
    OUT/results.csv  results.md  study.png
"""

from __future__ import annotations

from colocated_grpo.analysis.notebook import FIGURES, require_extra
from colocated_grpo.bench.study import report, running
from colocated_grpo.provenance import command_parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = command_parser("colocated_grpo.bench.study", __doc__, prog)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run every case and bench of a study, then write the report")
    run_parser.add_argument("definition", help="a study YAML, e.g. sweeps/studies/h200_x2.yaml")
    run_parser.add_argument("--out", required=True, help="the study directory (created; finished repeats are kept)")
    run_parser.add_argument(
        "--only",
        nargs="+",
        metavar="MODEL/CASE",
        help="run only these steps (shell patterns, e.g. '*1.5b*/fsdp'; '*/fsdp/rep2': its repeat 2 alone)",
    )
    run_parser.add_argument(
        "--trial",
        action="store_true",
        help="run a study kept under sweeps/results/ from uncommitted code; its report marks each of these runs",
    )
    plan_parser = sub.add_parser("plan", help="print the steps `run` would take and their commands; runs nothing")
    plan_parser.add_argument("definition", help="a study YAML")
    plan_parser.add_argument("--out", help="a study directory: its finished steps are shown as kept")
    plan_parser.add_argument("--only", nargs="+", metavar="MODEL/CASE", help="only these steps (shell patterns)")
    report_parser = sub.add_parser("report", help="write results.csv, results.md and study.png of a study directory")
    report_parser.add_argument("out", help="a study directory written by `run`")
    args = parser.parse_args(argv)
    if args.command == "plan":
        running.show(args.definition, args.out, args.only)
        return
    if args.command == "run":
        require_extra("notebooks", FIGURES, "study run (its report draws study.png)")
        running.run(args.definition, args.out, args.only, args.trial)
    else:
        require_extra("notebooks", FIGURES, "study report (it draws study.png)")
    report.report(args.out)


if __name__ == "__main__":
    main()
