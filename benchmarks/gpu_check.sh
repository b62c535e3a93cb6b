#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one device call.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [TRAFFIC_FILE]
#   BUDGET=420 PARTS="bench tests train checkpoint load" (the defaults; a rerun names fewer)
#
# The device's limits shape it: a lease is 15 minutes with the machine's start, one call 10,
# and 8 files come back. So the whole check ends within BUDGET seconds (420: a rerun of a
# part still fits the lease), each part under a time limit of its own and of what is left,
# most wanted first (the codec issue's numbers, the CUDA tests, then the trainer's runs,
# the trainer issue's first, then a checkpoint's cost); results are written as they
# come, in at most 7 files:
#   env.txt     the card and versions, then each part's seconds and exit status (or why
#               it was skipped)
#   bench.txt, gpu.json   benchmarks/bench_gpu.py (codec GB/s, ratio, syncs, launches,
#               break-even, the one-GPU step's ratio); its JSON rewritten after each stage
#   tests.txt   the CUDA tests (they skip on CI): the format-3 kernels against the CPU
#               reference, damaged payloads, no host sync in a one-GPU step, format 4 of
#               the casts, bounds by the range kernel, the DDP hooks on CUDA gradients,
#               the id-aware exchange's gradient on CUDA against the CPU, --cuda-graph
#               against eager steps, prefetched batches while the GPU lags, the syncs
#               counted on the CPU, --compress auto's timing, metrics, half tables, a
#               --profile's kernels (not its ranges' annotations),
#               tables made on the GPU as on the CPU, a GPU run against the CPU's, a
#               SIGTERM's checkpoint written in the background and resumed
#   train.jsonl, train.log   benchmarks/gpu_train.py: the trainer at batch 8192, one
#               process for all its runs (a line each as it ends), side by side at the end;
#               `none` and `hybrid` (fixed-size and id-aware) profiled over 10 steps
#               (`recsz train --profile`): GPU busy, kernels a step, ms per stage
#   checkpoint.txt   benchmarks/bench_checkpoint.py on the GPU: background against at once;
#               then benchmarks/bench_load.py: a checkpoint's load, its GPU memory
#
# The GPU image has torch, Triton and numba but not zstandard or lz4, and ../shared/data does
# not travel: `make gpu-prep` puts their wheels (Python 3.12) in .whl/ and the real traffic in
# .traffic/real.pt (28 MB with the tree: the carry limit is 64 MiB); then carry both:
#   run(command="bash benchmarks/gpu_check.sh $OUT .traffic/real.pt", carry=[".whl", ".traffic"])
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [TRAFFIC_FILE]}
traffic=${2:-}
budget=${BUDGET:-420}
parts=${PARTS:-bench tests train checkpoint load}
end=$(($(date +%s) + budget))  # the whole check's end, seconds since the epoch
mkdir -p "$out"
export PYTHONPATH=$PWD/src
if ! python3 -c "import zstandard, lz4" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$out/env.txt"

# part NAME LIMIT_S CMD...: CMD under the smaller of LIMIT_S and what the budget leaves (10 s
# kept for the end); skipped where under 20 s would be left; its line goes to env.txt.
part() {
    local name=$1 limit=$2
    shift 2
    case " $parts " in *" $name "*) ;; *) return 0 ;; esac
    local left=$((end - $(date +%s) - 10))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "part $name: skipped, ${left} s of the budget left" | tee -a "$out/env.txt"
        return 0
    fi
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "part $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/env.txt"
}

# 1. Codec throughput, ratio, syncs, launches, break-even and the training step ratio.
bench_args=(--json-out "$out/gpu.json")
[ -n "$traffic" ] && bench_args+=(--traffic "$traffic")
part bench 170 bash -c 'set -o pipefail; python3 benchmarks/bench_gpu.py "$@" 2>&1 | grep -v Warn | tee "'"$out"'/bench.txt"' \
    _ "${bench_args[@]}"

# 2. The CUDA tests; each under a minute where pytest-timeout is there (the GPU image has it).
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)
part tests 120 bash -c 'set -o pipefail; python3 -m pytest -q -rfE -p no:cacheprovider "$@" 2>&1 | tee "'"$out"'/tests.txt"' \
    _ "${per_test[@]}" tests/test_blocks.py tests/test_castframe.py tests/test_policy.py \
    tests/test_model.py tests/test_dp_hooks.py tests/test_exchange.py tests/test_stepgraph.py \
    tests/test_synthetic.py tests/test_host_syncs.py tests/test_switch.py tests/test_metrics.py \
    tests/test_tabledtype.py tests/test_tableinit.py tests/test_train.py tests/test_checkpoint.py \
    tests/test_profiling.py -k "cuda or gpu"

# 3. The trainer on one GPU at batch 8192 (benchmarks/gpu_train.py says which runs and why),
#    each run's summary a line of train.jsonl as it ends; a process whose CUDA context a run
#    broke is started again for the runs not yet recorded. No run starts after the time the
#    checkpoint and load parts need (100 s and 50 s, where they are among PARTS).
keep=15
case " $parts " in *" checkpoint "*) keep=$((keep + 100)) ;; esac
case " $parts " in *" load "*) keep=$((keep + 50)) ;; esac
part train 400 bash -c '
    rc=3
    while [ $rc = 3 ]; do  # 3: a run broke the CUDA context; the rest in a new process
        python3 benchmarks/gpu_train.py "$0" --deadline $(('"$end"' - '"$keep"')) \
            ${GPU_TRAIN_ARGS:-} 2>&1 | grep -v Warn >>"$0/train.log"
        rc=${PIPESTATUS[0]}
    done
    exit $rc' "$out"
python3 benchmarks/gpu_train.py "$out" --table | tee -a "$out/train.log"

# 4. What a checkpoint costs the loop on a GPU: written in the background (the GPU's way)
#    against at once (the CPU's), a 4.3 GB state (kaggle preset) every 10 steps.
part checkpoint 120 bash -c 'set -o pipefail; python3 benchmarks/bench_checkpoint.py --device cuda --preset kaggle \
    --steps 40 --every 10 --batch-size 8192 --repeats 1 --json-out /tmp/recsz_gpu/checkpoint.json \
    2>&1 | grep -v Warn | tee "'"$out"'/checkpoint.txt"'
# 5. What loading a checkpoint takes on the GPU above the model (the file memory-mapped on the
#    host since the forty-second session: read whole onto the GPU before), its table added
#    to checkpoint.txt.
part load 50 bash -c 'set -o pipefail; python3 benchmarks/bench_load.py --repeats 1 \
    --flags "--preset bench --emb-optimizer adagrad --device cuda" \
    --json-out /tmp/recsz_gpu/load.json 2>&1 | grep -v Warn | tee -a "'"$out"'/checkpoint.txt"'
echo "gpu_check: ${SECONDS} s" | tee -a "$out/env.txt"
