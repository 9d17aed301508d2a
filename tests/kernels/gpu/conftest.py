"""The Triton kernels' tests run in Triton's interpreter on CPU tensors (no GPU here): the
environment is set before any kernel module is imported."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels' tests need triton (pip install 'tripod[gpu-test]')")
