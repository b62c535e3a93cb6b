#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call (device time is short).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [TRAFFIC_FILE]
#
# The GPU image has torch but not this project's pure-Python extras: carry wheels for
# Python 3.12 in .whl/ (zstandard>=0.25, lz4; see /work/.library/device/README.md), and
# optionally real traffic saved here by `python benchmarks/bench_gpu.py --save-traffic F`.
# Writes the CUDA tests' log, bench_gpu's JSON and the 1-GPU training summaries to OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [TRAFFIC_FILE]}
traffic=${2:-}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src
else
    export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/env.txt"

# 1. The CUDA tests (they skip on CI): device codecs, baselines on CUDA, 1-GPU training.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_huffman.py \
    tests/test_train.py -k "cuda or gpu or device or baselines" 2>&1 | tail -15 | tee "$out/tests.txt"

# 2. Codec throughput and a training step through the codec (bench_gpu.py).
args=(--json-out "$out/gpu.json")
[ -n "$traffic" ] && args+=(--traffic "$traffic")
timeout 300 python3 benchmarks/bench_gpu.py "${args[@]}" 2>&1 | grep -v Warn | tee "$out/bench.txt"

# 3. The trainer on one GPU, uncompressed and compressed (no wire with one rank: this
#    measures what compression costs there, not what it saves), at the batch the trainer
#    issue's target names (8192) and at 2048 for comparison with earlier results.
for bs in 2048 8192; do
    for c in none hybrid; do
        timeout 120 python3 -m recsz.train --device cuda --preset bench --steps 40 \
            --batch-size "$bs" --fwd-codec "$c" --bwd-codec "$c" --eb-policy dual \
            --synthetic-eval 8192 --no-progress --out "$out/train_${c}_$bs" 2>&1 | tail -10
    done
done
