#!/usr/bin/env bash
# ResNet-50 on one GPU: epochs of CIFAR-10-shaped data (50,000 random images written in the
# real pickle format, held on the GPU as uint8 and augmented there by the trainer), batch 256,
# bf16 autocast + channels_last, eager and then with --compile, for the built-in CIFAR variant
# and torchvision's resnet50. Each run does two epochs: epoch 1 pays for cuDNN autotuning and
# compilation, epoch 2 is the figure. Prints epoch seconds, images/s and achieved TFLOP/s
# against the device's dense bf16 peak (FLOPs counted by FlopCounterMode, bench/gpu_report.py).
# Reference point: a widely read DDP tutorial reports 13.2 s for this epoch on one A100 with a
# plain DataLoader; the target here is <= 2.0 s on one H200. Needs only python3 with torch
# (torchvision for tv:resnet50); the trainer runs from trainer/src, nothing is installed.
#
#   bench/gpu.sh                    # on the GPU machine, from anywhere in the repo (< 5 minutes)
#   GPU_BENCH_DRY=1 bench/gpu.sh    # the same steps on the CPU, tiny sizes, convnet: checks the script
#                                   # (with MODELS="resnet50 tv:resnet50" it takes ~13 min on 2 cores)
#
# Overrides: PYTHON (python3), MODELS ("resnet50 tv:resnet50"), MODES ("eager compile"),
# IMAGES (50000), BATCH (256), EPOCHS (2), PEAK_TFLOPS (989 on an H100/H200, else unset: no MFU).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/trainer/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [[ ${GPU_BENCH_DRY:-0} == 1 ]]; then
    device=cpu
    default_models=convnet
    images=${IMAGES:-256}
    batch=${BATCH:-32}
    epochs=${EPOCHS:-2}
    peak=${PEAK_TFLOPS:-}
else
    device=cuda
    default_models="resnet50 tv:resnet50"
    images=${IMAGES:-50000}
    batch=${BATCH:-256}
    epochs=${EPOCHS:-2}
    name=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')
    case "$name" in
        *H100* | *H200*) peak=${PEAK_TFLOPS:-989} ;;
        *) peak=${PEAK_TFLOPS:-} ;;
    esac
    echo "device: $name; dense bf16 peak: ${peak:-unknown} TFLOP/s"
fi
read -r -a models <<<"${MODELS:-$default_models}"
read -r -a modes <<<"${MODES:-eager compile}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -c "import sys; from pathlib import Path; from bench.cifar_files import write_cifar10; \
write_cifar10(Path(sys.argv[1]), int(sys.argv[2]), 10000 if int(sys.argv[2]) >= 50000 else 256)" \
    "$work/data" "$images"

start=$SECONDS
for model in "${models[@]}"; do
    for mode in "${modes[@]}"; do
        flags=()
        [[ $mode == compile ]] && flags+=(--compile)
        metrics="$work/metrics-${model//:/-}-$mode.jsonl"
        "$PYTHON" -m ddpk_trainer --model "$model" --dataset cifar10 --data-dir "$work/data" \
            --device "$device" --batch-size "$batch" --epochs "$epochs" --amp bf16 --channels-last \
            --lr-schedule constant --resume none --metrics-file "$metrics" "${flags[@]}" >"$work/log" 2>&1 ||
            { cat "$work/log"; exit 1; }
        "$PYTHON" -m bench.gpu_report --model "$model" --batch-size "$batch" --images "$images" \
            --metrics-file "$metrics" --label "$mode" ${peak:+--peak-tflops "$peak"}
    done
done
echo "total wall time: $((SECONDS - start)) s"
