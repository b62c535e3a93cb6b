"""The one-process run the distributed runs are compared with (once a module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.runs import run


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    run(out)
    return out
