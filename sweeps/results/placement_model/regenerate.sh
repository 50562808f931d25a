#!/usr/bin/env bash
# Rebuild every file of this directory from the committed runs (no GPU): the calibration from the calibration
# subset of sweeps/results/calibration_h200, the validation of every committed job, the one-GPU scaling figure and
# the 8-GPU predictions. Run from the repository root: bash sweeps/results/placement_model/regenerate.sh
set -euo pipefail
P="python -m colocated_grpo.bench.placement"
D=sweeps/results/placement_model
CAL=$D/calibration_h200.json
$P calibrate sweeps/results/calibration_h200 --study sweeps/studies/calibration_h200.yaml --out $CAL
$P validate --calibration $CAL sweeps/results/calibration_h200 sweeps/results/plain_trl_h200 \
    sweeps/results/parallelism_h200 sweeps/results/h200_x2 \
    sweeps/results/tp_x_gpu_mem_1.5b/tp1_tp2_first_run sweeps/results/tp_x_gpu_mem_1.5b/tp2_mem0.5_0.7 --out $D > /dev/null
$P scaling --calibration $CAL --model-params 1.544 sweeps/results/calibration_h200 --out $D/scaling_1.5b.png \
    > $D/scaling_1.5b.txt
{
    echo "# Predictions for 8 × H200 from the one-GPU calibration"
    echo
    echo "Not measured: each block is one \`predict\` command and its output (docs/placement.md: the model, its"
    echo "validation and limits). \`(fast)\`: our colocated request and sync; \`(trl)\`: TRL's own; servers use TRL's"
    echo "request and sync, the only ones server mode has. Made by \`bash $D/regenerate.sh\`."
    # 7B is extrapolated, which takes two calibrated sizes
    sizes=$(python -c "import json; print(len(json.load(open('$CAL'))['models']))")
    for params in 1.544 $([ "$sizes" -ge 2 ] && echo 7.616); do
        for work in "128 512" "1024 1024"; do
            set -- $work
            for request in fast trl; do
                figure=""
                [ "$request" = fast ] && figure="--figure $D/predict_8gpu_${params}b_${1}x${2}.png"
                command="$P predict --calibration $CAL --gpus 8 --completions $1 --prompt-tokens 150 --completion-tokens $2 --model-params $params --request $request $figure"
                echo; echo '```'; echo "\$ ${command/python -m/python -m}"; $command; echo '```'
            done
        done
    done
} > $D/predictions.md
