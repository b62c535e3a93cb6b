#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call (device time is short).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [TRAFFIC_FILE]
#
# The GPU image has torch and Triton but not this project's pure-Python extras: carry
# wheels for Python 3.12 in .whl/ (zstandard>=0.25, lz4; see /work/.library/device/README.md)
# and the real traffic saved here by `python benchmarks/bench_gpu.py --save-traffic F`
# (../shared/data does not travel). Writes the CUDA tests' log, bench_gpu's JSON and
# the 1-GPU training summaries to OUT_DIR. Each part has its own time limit (about 5-9
# minutes in all; a lease is 15 minutes, the machine's start included), so one failing
# part leaves the others' results.
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
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/env.txt"

# 1. The CUDA tests (they skip on CI): the format-3 kernels against the CPU reference,
#    damaged payloads, no host sync in a one-GPU exchange step, format 4 of the casts,
#    bounds by the range kernel, no host sync in a whole one-GPU training step, the eb and
#    DCT-DP hooks on CUDA gradients (lengths by gloo, payloads by NCCL, one rank), the
#    id-aware exchange's sparse, deferred gradient on CUDA against the CPU, the whole step
#    replayed as CUDA graphs (--cuda-graph) against eager steps, prefetched batches intact
#    while the GPU lags the host, the syncs of a step (fixed-size: none; id-aware: one) as
#    counted on the CPU (tests/hostreads.py), --compress auto's trial timing queued GPU work,
#    the held-out numbers computed on the GPU as on the CPU.
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_blocks.py \
    tests/test_castframe.py tests/test_policy.py tests/test_model.py tests/test_dp_hooks.py \
    tests/test_exchange.py tests/test_stepgraph.py tests/test_synthetic.py tests/test_host_syncs.py \
    tests/test_switch.py tests/test_metrics.py tests/test_tabledtype.py \
    -k "cuda or gpu" 2>&1 | tail -25 | tee "$out/tests.txt"

# 2. Codec throughput, ratio, syncs, launches, break-even and the training step ratio.
args=(--json-out "$out/gpu.json")
[ -n "$traffic" ] && args+=(--traffic "$traffic")
timeout 240 python3 benchmarks/bench_gpu.py "${args[@]}" 2>&1 | grep -v Warn | tee "$out/bench.txt"

# 3. The trainer on one GPU at batch 8192 (the trainer issue's target), uncompressed and
#    compressed (no wire with one rank: this measures what compression costs there); 40
#    steps, so that samples_per_s_steady (after the first 3) is past compiles and captures
#    and mostly past the policy's 10-step probe window. Only the summaries come back.
#    First the fixed-size, sync-free step ("--no-id-dedup --no-bwd-coalesce"), 100 steps,
#    eagerly and replayed as CUDA graphs (--cuda-graph: the policy's 10-step probe window
#    and its classification run eagerly); then the trainer's default, id-aware traffic
#    (sizes change every step: eager coder, a few syncs), the MLPs under torch.compile
#    (--compile), then in bfloat16 (--dense-dtype bf16), then on MLPerf's multi-hot bags,
#    (hashed, then MLPerf's own draws: --multi-hot-draws mlperf, gathered on the GPU),
#    then with half-precision tables (--table-dtype fp16: stochastic rounding on the GPU),
#    then with every table in 4 column shards (--column-shards 4: 104 tables of dim 16).
#    The default runs ("none", "hybrid") evaluate 2^20 held-out samples (eval_s: the
#    evaluation's seconds, its metrics on the GPU), the others 8192.
fixed="--no-id-dedup --no-bwd-coalesce"
mh="--multi-hot mlperf --emb-lr 0.01"  # MLPerf's bags, 214 ids a sample
for run in "none $fixed" "none $fixed --cuda-graph" "hybrid $fixed" \
    "hybrid $fixed --cuda-graph" none hybrid "hybrid --compile" "none --dense-dtype bf16" \
    "hybrid --dense-dtype bf16" "none $mh" "hybrid $mh" "hybrid $mh --multi-hot-draws mlperf" \
    "none --interaction dcn" \
    "hybrid --interaction dcn" "hybrid --compress auto" "hybrid --table-dtype fp16" \
    "hybrid --column-shards 4"; do
    c=${run%% *}
    steps=40
    n_eval=8192
    case "$run" in *"$fixed"*) steps=100 ;; none | hybrid) n_eval=1048576 ;; esac
    name=train_$(echo "$run" | sed 's/ --/_/g; s/[- ]/_/g')_8192
    timeout 90 python3 -m recsz.train --device cuda --preset bench --steps $steps \
        --batch-size 8192 --fwd-codec "$c" --bwd-codec "$c" --eb-policy dual \
        --synthetic-eval $n_eval --no-progress --out "/tmp/recsz_gpu/$name" ${run#"$c"} \
        2>&1 | tail -12
    cp "/tmp/recsz_gpu/$name/summary.json" "$out/$name.json" 2>/dev/null
done
# 3b. One evaluation of 2^20 held-out samples at two evaluation batches (on the CPU here
#     4096 was the fastest: results/session33/eval_batches.md; a GPU pays its launches a batch).
for eb in 4096 65536; do
    timeout 60 python3 -m recsz.train --device cuda --preset bench --steps 1 --batch-size 8192 \
        --synthetic-eval 1048576 --eval-batch-size $eb --no-progress \
        --out "/tmp/recsz_gpu/eval_$eb" 2>&1 | grep evaluation
    cp "/tmp/recsz_gpu/eval_$eb/summary.json" "$out/eval_batch_$eb.json" 2>/dev/null
done
# 4. The trainer runs side by side (steady samples/s after the first 3 steps).
python3 - "$out" <<'PY' | tee "$out/train.txt"
import json, pathlib, sys

for f in sorted(pathlib.Path(sys.argv[1]).glob("train_*.json")):
    s = json.loads(f.read_text())
    print(f"{f.stem:52s} {s.get('samples_per_s_steady', float('nan')):>10.0f} samples/s "
          f"replays {s.get('graph_replays', 0):>3} AUC {s.get('auc', float('nan')):.4f} "
          f"eval {s.get('eval_samples', 0)} in {s.get('eval_s', float('nan')):.2f} s")
PY
echo "gpu_check: ${SECONDS} s"
