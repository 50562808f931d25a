#!/usr/bin/env bash
# The H200 runs still to make, as calls of a few minutes each (python -m colocated_grpo.bench.study run … --only …),
# each stopped by `timeout` before ten minutes:
#   - each switch of sweeps/studies/switches_h200.yaml against the defaults, every completion to the cap and at the
#     realistic length profile: a switch and its defaults interleaved in one call, into a directory of their own;
#   - the engine in a process of its own (placement=colocate_process, same settings) against in-process colocate, and
#     overlap (placement.overlap=true) against colocate_process, at both length profiles, the same way;
#   - sweeps/studies/speed_h200.yaml (ours against plain TRL, at natural stop and at the realistic profile): one
#     repeat of one block of cases a call, in the study's order, all into one directory. Those calls continue one
#     study: OUT/speed_h200 must be there for the next call (bring it back to a new machine);
#   - GPU tests (study `pytest`, steps: test files): `pytest -m gpu` on them, its JUnit report into OUT/DIRECTORY.
#     engine_process_gpu runs placement=colocate_process's GPU path (CUDA IPC handles) once: run it first;
#     packing_gpu, packed micro-batches through varlen_attn against the padded forward;
#   - levers_realistic, levers_cap, then levers_process: the placements and packing against the defaults, in one
#     directory (longer than one call: a larger LIMIT_S where a queue runs them, or the same call again, which
#     continues the directory).
#
#   bash sweeps/studies/h200_plan.sh                  list the calls
#   bash sweeps/studies/h200_plan.sh --dry-run [OUT]  each call's command, its steps and theirs (the study runner's
#                                                     `plan`; a GPU test call's command only): nothing runs; with
#                                                     OUT, steps finished there are kept
#   bash sweeps/studies/h200_plan.sh CALL OUT         run one call into OUT under `timeout` (exit 124: it stopped it)
#
# PYTHON (python3), LIMIT_S (520: SIGTERM then, the running job saves and the study stops; SIGKILL 60 s later).
set -euo pipefail
set -f # the steps are patterns for the study runner, not for this shell
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-520}

# call                study          directory under OUT              steps (MODEL/CASE[/rep<k>] patterns; test files)
CALLS="
engine_process_gpu    pytest         gpu_tests/engine_process         tests/test_engine_process_gpu.py
packing_gpu           pytest         gpu_tests/packing                tests/test_training_packing_gpu.py
v2_cap                switches_h200  switches_h200/v2_cap             */cap_256 */cap_v2_256
padded_cap            switches_h200  switches_h200/padded_cap         */cap_256 */cap_padded_256
compile_cap           switches_h200  switches_h200/compile_cap        */cap_256 */cap_compile_256
liger_cap             switches_h200  switches_h200/liger_cap          */cap_256 */cap_liger_256
balanced_cap          switches_h200  switches_h200/balanced_cap       */cap_256 */cap_balanced_256
v2_realistic          switches_h200  switches_h200/v2_realistic       */realistic_256 */realistic_v2_256
padded_realistic      switches_h200  switches_h200/padded_realistic   */realistic_256 */realistic_padded_256
compile_realistic     switches_h200  switches_h200/compile_realistic  */realistic_256 */realistic_compile_256
liger_realistic       switches_h200  switches_h200/liger_realistic    */realistic_256 */realistic_liger_256
balanced_realistic    switches_h200  switches_h200/balanced_realistic */realistic_256 */realistic_balanced_256
process_cap           switches_h200  switches_h200/process_cap        */cap_256 */cap_process_256
overlap_cap           switches_h200  switches_h200/overlap_cap        */cap_process_256 */cap_overlap_256
process_realistic     switches_h200  switches_h200/process_realistic  */realistic_256 */realistic_process_256
overlap_realistic     switches_h200  switches_h200/overlap_realistic  */realistic_process_256 */realistic_overlap_256
levers_realistic      switches_h200  switches_gpu  */realistic_256 */realistic_padded_256 */realistic_overlap_256
levers_cap            switches_h200  switches_gpu  */cap_256 */cap_overlap_256
levers_process        switches_h200  switches_gpu  */*_process_256"
for r in rep1 rep2 rep3; do
  CALLS+="
speed_256_$r          speed_h200     speed_h200  */ours_256/$r */plain_256/$r */plain_ours_256/$r */ours_v2_256/$r
speed_realistic_$r    speed_h200     speed_h200  */*_realistic_256/$r
speed_128_$r          speed_h200     speed_h200  */*_128/$r"
done

# Call $1's study, directory and steps (`study`, `dir`, `steps`); false for no such call.
find_call() {
  read -r _ study dir steps < <(awk -v call="$1" '$1 == call' <<<"$CALLS")
}

names=$(awk 'NF { print $1 }' <<<"$CALLS")
case "${1:-}" in
  "")
    echo "$names"
    ;;
  --dry-run)
    out=${2:-OUT}
    for name in $names; do
      find_call "$name"
      if [[ $study == pytest ]]; then
        echo "== $name: timeout --kill-after=60 $LIMIT_S $PYTHON -m pytest -p no:cacheprovider -m gpu -n 0 $steps" \
          "--junitxml $out/$dir/junit.xml"
        continue
      fi
      echo "== $name: timeout --kill-after=60 $LIMIT_S $PYTHON -m colocated_grpo.bench.study run" \
        "sweeps/studies/$study.yaml --out $out/$dir --only $steps"
      "$PYTHON" -m colocated_grpo.bench.study plan "$REPO/sweeps/studies/$study.yaml" --out "$out/$dir" --only $steps
    done
    ;;
  *)
    if [[ $# -ne 2 ]] || ! find_call "$1"; then
      echo "usage: bash sweeps/studies/h200_plan.sh [--dry-run [OUT] | CALL OUT]; the calls:" $names >&2
      exit 2
    fi
    if [[ $study == pytest ]]; then
      tests=()
      for test in $steps; do tests+=("$REPO/$test"); done
      mkdir -p "$2/$dir"
      exec timeout --kill-after=60 "$LIMIT_S" "$PYTHON" -m pytest -p no:cacheprovider -m gpu -n 0 "${tests[@]}" \
        --junitxml "$(realpath -m "$2")/$dir/junit.xml"
    fi
    exec timeout --kill-after=60 "$LIMIT_S" "$PYTHON" -m colocated_grpo.bench.study run \
      "$REPO/sweeps/studies/$study.yaml" --out "$(realpath -m "$2")/$dir" --only $steps
    ;;
esac
