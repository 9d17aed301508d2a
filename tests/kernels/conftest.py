"""The loaded CPU kernels of the best level here, for the kernel tests (skipped, saying why, on a
CPU with no level: not x86-64, or no AVX2)."""

from __future__ import annotations

from typing import Any

import pytest

from tripod import kernels


@pytest.fixture(scope="module")
def ops() -> Any:
    why = kernels.unavailable_reason()
    if why is not None:
        pytest.skip(f"tripod's CPU kernels are unavailable here: {why}")
    assert kernels.load(wait=True), f"the kernels should build on this machine: {kernels.unavailable_reason()}"
    return kernels.ops()
