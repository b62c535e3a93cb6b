# The two commands a newcomer types: `make demo` and `make test`. Each sets itself up.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
TORCHREC := $(VENV)/.torchrec-1.8.0-iopath

.PHONY: demo test lint bench anchors gpu-prep gpu-torch clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# (runs/demo afresh each time: a finished run's directory would be resumed, "nothing to do",
# or refused as another run's after an upgrade changed the configuration's format)
demo: $(STAMP)
	@rm -rf runs/demo
	$(BIN)/recsz train --preset tiny --nproc 2 --steps 300 --batch-size 256 \
		--fwd-codec hybrid --bwd-codec hybrid --eb-policy dual --out runs/demo

test: $(STAMP) $(TORCHREC)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q -n auto --dist loadscope --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy src

# TorchRec itself: recsz.torchrec's tests (make test) and the DMP anchor of
# benchmarks/bench_train.py (configs trdmp-*). Its wheel asks for the CUDA fbgemm-gpu, so it
# goes in without dependencies, and what it needs beside the CPU fbgemm comes pinned here
# (all pure Python; torch stays 2.13.0). iopath: TorchRec's file reader, with which the tests
# write Criteo days as TorchRec preprocesses them (tests/test_npydays.py).
$(TORCHREC): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt fbgemm-gpu-cpu==1.8.0 \
		tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions==0.0.32 iopath==0.1.10
	$(BIN)/python -m pip install --quiet --no-deps torchrec==1.8.0
	@touch $(TORCHREC)

anchors: $(TORCHREC)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_codecs.py --quick

# What a session with a lent GPU carries (carry: [".whl", ".traffic"]), made here first: the
# pure-Python extras the GPU image lacks, as wheels for its Python 3.12, and real traffic
# (../shared/data does not travel). Then: bash benchmarks/gpu_check.sh $$OUT .traffic/real.pt
gpu-prep: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl "zstandard==0.25.0" "lz4==4.4.5"
	$(BIN)/python benchmarks/bench_gpu.py --save-traffic .traffic/real.pt

# The GPU image's Python and torch (3.12 where there is one; torch 2.11 and its triton 3.6,
# PyPI's CUDA build, ~5 GB, which runs on the CPU here) in a venv of its own, before a lent
# GPU spends its minutes on what they do differently: the suite (less TorchRec's anchors:
# fbgemm 1.8 does not load on 2.11, and the GPU image has no TorchRec), then the GPU check's
# trainer runs, tiny, down the GPU's code path under Triton's interpreter (the --cuda-graph
# runs refuse the CPU, as they should).
GPU_BIN := .venv-gpu/bin
GPU_PY  ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) python3.12)
gpu-torch:
	@test -x $(GPU_BIN)/python || $(GPU_PY) -m venv .venv-gpu || $(PY) -m venv .venv-gpu
	$(GPU_BIN)/python --version
	$(GPU_BIN)/python -m pip install --quiet torch==2.11.0 triton==3.6.0 -e '.[baselines]' \
		pytest pytest-xdist hypothesis scikit-learn
	$(GPU_BIN)/python -m pytest -q -n auto -p no:cacheprovider -k "not tr-" tests
	rm -rf runs/gpu-torch
	RECSZ_DEVICE_PATH_ON_CPU=1 TRITON_INTERPRET=1 $(GPU_BIN)/python benchmarks/gpu_train.py \
		runs/gpu-torch --dry --runs runs/gpu-torch/runs
	! grep '"error"' runs/gpu-torch/train.jsonl | grep -v 'cuda-graph replays'

clean:
	rm -rf $(VENV) .venv-gpu runs .pytest_cache
