#!/usr/bin/env bash
# GPU checks and benchmark of the ROS-free engine and models: the CUDA-only tests, then full-size
# π0.5 in bf16 on CUDA.
#
# Runs on a machine with PyTorch (CUDA), transformers, tokenizers, safetensors, numpy and pyyaml
# installed, from the repository root, with no ROS and no set-up step:
#     OUT=bench-results/gpu scripts/device_bench.sh
# The weights are random (no checkpoint is downloaded) and the prompt uses the offline tiny
# tokenizer over the preset's vocabulary: timings depend on shapes, not on weight values. The
# engine table follows the paper's protocol (S = 10, H = 10, one speech request per frame).
# Runs the tests in TESTS first (default: the CUDA-graph tests, which skip on a CPU-only machine;
# empty: none; needs pytest). Writes the test log, the engine table (text + JSON, the JSON updated
# after every group) and the model bench (text) under $OUT. Override PRESET, DTYPE, DEVICE, FRAMES,
# KV_MIB (KV pool budget per engine), TOKENIZER (the engine bench's --tokenizer-path; empty: the
# preset's own), ENGINE_ARGS (more engine-bench flags), MODEL_PRESETS (empty: no model bench),
# MODEL_ARGS (more model-bench flags), TESTS_TIMEOUT, ENGINE_TIMEOUT and MODEL_TIMEOUT (seconds). The README's H200 tables
# (CUDA graphs on) came from two runs on one machine:
#     OUT=$OUT ENGINE_TIMEOUT=330 ENGINE_ARGS="--n 30" MODEL_PRESETS="pi05" scripts/device_bench.sh
#     OUT=$OUT TESTS="" ENGINE_TIMEOUT=330 ENGINE_ARGS="--n 5 10 20" MODEL_PRESETS="" scripts/device_bench.sh
# (about 4.5 and 4 min of device time; eager PyTorch needed about 5 min for N = 30 alone).
#
# DRY=1 runs every step of the script on the CPU instead (test/test_device_bench.py does, in `make test`):
# pi05_tiny in fp32 with its own tokenizer, one frame per setting, the CUDA-graph path with direct calls
# (--graph-backend direct: buckets, static buffers and replay selection without capture and replay), the
# cheapest CUDA-graph test and a one-repeat model bench; writes under bench-results/dry. The variables
# above still override it.
#     DRY=1 scripts/device_bench.sh
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
    OUT=${OUT:-bench-results/dry}
    PRESET=${PRESET:-pi05_tiny}
    DTYPE=${DTYPE:-float32}
    DEVICE=${DEVICE:-cpu}
    FRAMES=${FRAMES:-1}
    KV_MIB=${KV_MIB:-256}
    TOKENIZER=${TOKENIZER-}
    ENGINE_ARGS=${ENGINE_ARGS-"--n 2 --k 1 --rounds 1 --warmup 0 --deadline-frames 1 --graph-backend direct"}
    MODEL_PRESETS=${MODEL_PRESETS-pi05_tiny}
    MODEL_ARGS=${MODEL_ARGS-"--warmup 0 --repeats 1 --graph-backend direct"}
    TESTS=${TESTS-test/test_model_cuda_graphs.py::test_direct_calls_keep_the_graph_contract}
fi
OUT=${OUT:-bench-results/gpu}
PRESET=${PRESET:-pi05}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
FRAMES=${FRAMES:-30}
TOKENIZER=${TOKENIZER-tiny}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
status=0
TESTS=${TESTS-test/test_model_cuda_graphs.py}
if [ -n "$TESTS" ]; then
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q $TESTS 2>&1 | tee "$OUT/tests.txt" || status=1
fi
timeout "${ENGINE_TIMEOUT:-1800}" python3 -m oxygen_ros.bench.engine_bench --preset "$PRESET" --dtype "$DTYPE" \
    --device "$DEVICE" ${TOKENIZER:+--tokenizer-path "$TOKENIZER"} --action-horizon 10 --kv-budget-mb "${KV_MIB:-8192}" --frames "$FRAMES" \
    --out "$OUT/engine_bench_${PRESET}_${DEVICE}.json" ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine_bench_${PRESET}_${DEVICE}.txt" \
    || status=1
MODEL_PRESETS=${MODEL_PRESETS-pi05 pi0}
if [ -n "$MODEL_PRESETS" ]; then
    timeout "${MODEL_TIMEOUT:-120}" python3 -m oxygen_ros.bench.model_bench --device "$DEVICE" --dtype "$DTYPE" \
        --presets $MODEL_PRESETS --decode-batch 8 ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model_bench_${DEVICE}.txt" || status=1
fi
exit $status
