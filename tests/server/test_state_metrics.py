"""A hybrid model's state pool in ``/metrics``: from the heartbeat's ``EngineStats.states`` to
Prometheus gauges and counters; no series for a model without recurrent state (no model, no server)."""

from __future__ import annotations

from tripod.protocol.stats import EngineStats, StateStats
from tripod.server.metrics import ServerMetrics


def _beat(free: int, held: int, taken: int, restored: int) -> EngineStats:
    states = StateStats(slots=4, free=free, bytes_per_slot=1000, snapshot_slots=6, snapshots_held=held,
                        snapshot_bytes=held * 1000, snapshots_taken=taken, snapshots_restored=restored)
    return EngineStats(running=4 - free, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0, states=states)


def _value(text: str, series: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(series + " "))
    return float(line.split()[-1])


def test_the_state_pool_follows_the_heartbeats() -> None:
    m = ServerMetrics("h")
    m.on_heartbeat(_beat(free=3, held=2, taken=2, restored=0))
    m.on_heartbeat(_beat(free=4, held=5, taken=7, restored=3))  # counters are cumulative: only what is new is added
    text = m.render().decode()
    assert _value(text, 'tripod:state_slots{model_name="h"}') == 4
    assert _value(text, 'tripod:state_slots_free{model_name="h"}') == 4
    assert _value(text, 'tripod:state_slot_bytes{model_name="h"}') == 1000
    assert _value(text, 'tripod:state_snapshot_slots{model_name="h"}') == 6
    assert _value(text, 'tripod:state_snapshots_held{model_name="h"}') == 5
    assert _value(text, 'tripod:state_snapshot_bytes{model_name="h"}') == 5000
    assert _value(text, 'tripod:state_snapshots_taken_total{model_name="h"}') == 7
    assert _value(text, 'tripod:state_snapshots_restored_total{model_name="h"}') == 3


def test_no_recurrent_state_no_state_series() -> None:
    m = ServerMetrics("m")
    m.on_heartbeat(EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0))
    assert "tripod:state_slots{" not in m.render().decode() and "tripod:state_snapshot_bytes{" not in m.render().decode()
