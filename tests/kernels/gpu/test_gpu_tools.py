"""The GPU tooling that runs without a GPU: every kernel compiled for sm_90 (registers, spills,
shared memory; a failure or an oversized kernel fails the command), and the prepared device
check's dry run (the whole script on the CPU in Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _compile(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tripod.kernels.gpu", "compile", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600, check=False)


def test_every_kernel_compiles_for_sm_90_within_its_shared_memory() -> None:
    done = _compile("--target", "sm_90", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout[: done.stdout.rindex("]") + 1])
    names = {r["name"].split("[")[0].split(" ")[0] for r in results}
    assert {"rms_norm", "silu_mul", "rope_store_kv", "paged_attention", "combine_splits", "mla_decode",
            "w4a16", "w8a8_int8", "w8a16", "conv_update", "gated_delta", "ssd_scan"} <= names
    for r in results:
        assert r["ok"] and r["registers"] and 0 <= r["shared"] <= 227 * 1024, r
        assert r["spill_stores"] == 0 or "sinks" in r["name"], f"{r['name']} spills {r['spill_stores']} bytes"


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_a_kernel_over_the_shared_memory_limit_fails_the_command() -> None:
    done = _compile("--target", "sm_90", "--only", "mla_decode", "--max-shared", "1024")
    assert done.returncode == 1 and "shared memory" in done.stdout
    assert _compile("--target", "volta").returncode == 2  # not an sm_NN target: a usage error
    assert _compile("--only", "no-such-kernel").returncode == 2


@pytest.mark.slow
def test_the_device_check_runs_dry_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu/device_check.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and (tmp_path / "gpu_check.md").is_file()
    secs = report["sections"]
    assert set(secs) == {"kernels", "graphs", "smollm2_vs_hf", "ceilings", "llama_8b_shape", "deepseek_v2_lite_shape"}
    assert all("error" not in s for s in secs.values()), {k: s.get("error", "")[-500:] for k, s in secs.items()}
    assert all(k["ok"] for k in secs["kernels"]["result"])
    assert secs["graphs"]["result"]["replays_bit_exact"] == secs["graphs"]["result"]["replays"] > 0
    assert secs["smollm2_vs_hf"]["result"]["ok"]
    for model in ("llama_8b_shape", "deepseek_v2_lite_shape"):
        rows = secs[model]["result"]["rows"]
        assert rows and all(r["finished"] and r["output_tok_s"] > 0 for r in rows), rows
