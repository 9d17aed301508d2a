"""The disk tier's numbers in ``/metrics``: from the engine's cumulative heartbeat counters to
Prometheus counters per tier (no model, no server)."""

from __future__ import annotations

from tripod.protocol.stats import DiskTierStats, EngineStats
from tripod.server.metrics import ServerMetrics


def _beat(pool_and_disk: int, disk: int, written: int, corrupt: int) -> EngineStats:
    tier = DiskTierStats(dir="/d", capacity_bytes=1000, used_bytes=400, entries=2, block_tokens=16,
                         hit_tokens=disk, written_bytes=written, corrupt_files=corrupt)
    return EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0,
                       prefix_hit_tokens=pool_and_disk, kv_disk=tier)


def _value(text: str, series: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(series + " "))
    return float(line.split()[-1])


def test_tier_hits_and_disk_counters_follow_the_heartbeats() -> None:
    m = ServerMetrics("m")
    m.on_heartbeat(_beat(100, 64, 4096, 0))
    m.on_heartbeat(_beat(180, 96, 8192, 1))  # cumulative: only what is new is added
    text = m.render().decode()
    assert _value(text, 'tripod:prefix_cache_tier_hits_total{model_name="m",tier="disk"}') == 96
    assert _value(text, 'tripod:prefix_cache_tier_hits_total{model_name="m",tier="pool"}') == 84
    assert _value(text, 'tripod:kv_disk_written_bytes_total{model_name="m"}') == 8192
    assert _value(text, 'tripod:kv_disk_corrupt_files_total{model_name="m"}') == 1
    assert _value(text, 'tripod:kv_disk_usage_bytes{model_name="m"}') == 400
    assert _value(text, 'tripod:kv_disk_capacity_bytes{model_name="m"}') == 1000


def test_no_tier_no_disk_series() -> None:
    m = ServerMetrics("m")
    m.on_heartbeat(EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0))
    text = m.render().decode()
    assert "tier=" not in text and "kv_disk_usage_bytes{" not in text
    assert "kv_disk" not in EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0,
                                        kv_pinned=0).as_json()
