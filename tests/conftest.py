"""Shared fixtures: where the real Criteo samples live (../shared/data beside the repo)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Two tests at a time on two cores (pytest-xdist), each process and each rank it spawns on
# one thread (set before torch loads OpenMP; spawned ranks inherit it): with two threads
# each, the processes' OpenMP threads spin waiting for each other (a 3 s test took 81 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch

# Without a GPU, Triton kernels run under its interpreter (set before they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

# No per-example deadline: the suite runs two tests at a time on two cores (pytest-xdist),
# where an example's time says nothing of its test.
settings.register_profile("recsz", deadline=None)
settings.load_profile("recsz")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    """Each test leaves torch's thread count as it found it (a benchmark's main called here
    sets one thread, as its ranks run)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def criteo_10k() -> Path:
    p = SHARED_DATA / "criteo_kaggle_head10k.tsv"
    if not p.exists():
        pytest.skip(f"real Criteo sample not found at {p} (shared/data beside the checkout)")
    return p


@pytest.fixture
def criteo_ragged() -> Path:
    p = SHARED_DATA / "criteo_kaggle_head1k_ragged.tsv"
    if not p.exists():
        pytest.skip(f"real Criteo sample not found at {p} (shared/data beside the checkout)")
    return p


@pytest.fixture
def ctrl_c_heard() -> Iterator[None]:
    """SIGINT handled as Python's default does (KeyboardInterrupt) for the test, whatever the
    process started with (a shell starts a background job, e.g. `make test &`, with SIGINT
    ignored, which recsz then leaves ignored)."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
