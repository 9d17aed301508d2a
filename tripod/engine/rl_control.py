"""The engine loop's RL control surface: pause / continue, aborts, weight updates, sleep / wake,
prefix-cache resets (``protocol/engine_ipc.py``'s control messages, each answered by a
``ControlReply``). Handled in the engine process between steps, so a step never sees half a change.

``RLControl`` owns the state those messages change:

- **pause** ``abort`` ends every request in flight (finish reason ``abort``); ``wait`` lets them
  run to the end; ``keep`` stops stepping, so they stay exactly where they are, KV and sampler state
  included, and resume token for token on continue. In every mode new requests are held back
  (``held``) until ``ContinueGeneration``.
- **weight updates** are checked when they arrive (an invalid one is refused, nothing applied) and
  applied at the first step boundary where no request is in flight; until then no new request is
  admitted. So a request runs wholly on the weights it started with (NOTE: the invariant "one
  weight version per request"); requests frozen by ``keep`` would have to mix versions, so an
  update then is refused (continue them, or pause with ``abort``). The prefix cache is flushed on
  every update: no KV of old weights is reused.
- **sleep** (no request in flight) flushes the prefix cache and gives the KV pool's memory back
  (level 2: the weights too, reloaded from disk on wake); requests are held until wake.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tripod.engine.sleep import PoolRelease
from tripod.engine.weight_sync import WeightGroup
from tripod.engine.weight_update import StagedUpdate, UpdateError, WeightUpdater
from tripod.protocol import engine_ipc

if TYPE_CHECKING:
    from tripod.engine.engine import Engine

log = logging.getLogger(__name__)

# Joining a weight group and receiving over it block the loop: bounded below the server's heartbeat timeout.
GROUP_TIMEOUT_S = 20.0


@dataclasses.dataclass(slots=True)
class _Deferred:
    """A control message answered later (an update waiting for the requests in flight, a pause
    ``wait`` answered once they have drained)."""

    token: int
    update: StagedUpdate | None = None


class RLControl:
    """Owns pause mode, held requests, the pending weight update and the sleep level of one engine
    loop (and, through ``WeightUpdater``/``PoolRelease``, the weight version and the pool's memory)."""

    def __init__(self, engine: Engine, send: Callable[[engine_ipc.Message], None],
                 beat: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.send = send
        self.beat = beat  # the loop's heartbeat, when due: called inside long controls (updates)
        self.weights = WeightUpdater(engine, beat)
        self.pool = PoolRelease(engine.pool)
        self.group = WeightGroup()  # a trainer's torch.distributed group (InitWeightsGroup)
        self.paused = ""  # "" (running) or a PAUSE_MODES entry
        self.sleeping = 0  # 0 awake, else the level
        self.held: list[engine_ipc.AddRequest] = []
        self._update: _Deferred | None = None
        self._drained: list[int] = []  # pause(wait) tokens answered once nothing is in flight

    # ------------------------------------------------------------------ the loop's questions
    @property
    def frozen(self) -> bool:
        """No step may run (paused in place, or asleep)."""
        return self.paused == "keep" or self.sleeping > 0

    @property
    def admitting(self) -> bool:
        return not self.paused and not self.sleeping and self._update is None

    def hold(self, msg: engine_ipc.AddRequest) -> bool:
        """Keep ``msg`` back instead of adding it now (True), or let the loop add it."""
        if self.admitting:
            return False
        self.held.append(msg)
        return True

    def tick(self) -> list[engine_ipc.AddRequest]:
        """Between steps: apply a waiting update once nothing is in flight, answer drained pauses;
        returns the held requests that may now be added."""
        idle = not self.engine.pending
        if idle and self._update is not None:
            d, self._update = self._update, None
            assert d.update is not None
            self._reply(d.token, **self._apply(d.update))
        if idle and self._drained:
            for token in self._drained:
                self._reply(token)
            self._drained = []
        if self.admitting and self.held:
            out, self.held = self.held, []
            return out
        return []

    # ------------------------------------------------------------------ messages
    def handle(self, msg: engine_ipc.Control) -> None:
        t = msg.token
        if isinstance(msg, engine_ipc.PauseGeneration):
            self._pause(msg)
        elif isinstance(msg, engine_ipc.ContinueGeneration):
            self.paused = ""
            self._reply(t)
        elif isinstance(msg, engine_ipc.AbortRequests):
            self._reply(t, aborted=self._abort(msg.rids))
        elif isinstance(msg, engine_ipc.UpdateWeights):
            self._update_weights(msg)
        elif isinstance(msg, engine_ipc.InitWeightsGroup):
            try:
                self.group.join(msg.master_address, msg.master_port, msg.rank, msg.world_size, msg.backend,
                                GROUP_TIMEOUT_S)
                self._reply(t)
            except UpdateError as e:
                self._reply(t, error=str(e), kind=e.kind)
        elif isinstance(msg, engine_ipc.Sleep):
            self._sleep(msg)
        elif isinstance(msg, engine_ipc.WakeUp):
            self._wake(t)
        elif isinstance(msg, engine_ipc.ResetPrefixCache):
            if self.engine.pending:
                self._reply(t, error=self._busy("the prefix cache can be reset"), kind="conflict")
            else:
                self.engine.reset_prefix_cache()
                self._reply(t)
        else:
            raise AssertionError(f"unexpected control message {msg!r}")

    def _pause(self, msg: engine_ipc.PauseGeneration) -> None:
        if msg.mode not in engine_ipc.PAUSE_MODES:
            self._reply(msg.token, error=f"pause mode {msg.mode!r}: use one of {', '.join(engine_ipc.PAUSE_MODES)}",
                        kind="invalid")
            return
        self.paused = msg.mode
        aborted = self._abort_running() if msg.mode == "abort" else 0
        if msg.mode == "wait" and self.engine.pending:
            self._drained.append(msg.token)  # answered once they have finished
            return
        self._reply(msg.token, aborted=aborted)

    def _abort_running(self) -> int:
        """End every request the engine holds (not the held-back ones: they have not started)."""
        e = self.engine
        live = [r for r in e.admission.reqs.values() if not r.finished]
        for r in live:
            e.scheduler.abort(r)
        self._report_finished()
        return len(live)

    def _abort(self, rids: list[str]) -> int:
        e = self.engine
        wanted = set(rids)
        live = [r for r in e.admission.reqs.values() if not r.finished and (not wanted or r.rid in wanted
                                                                             or r.group in wanted)]
        for r in live:
            e.scheduler.abort(r)
        self._report_finished()
        held = [m for m in self.held if not wanted or m.rid in wanted]
        self.held = [m for m in self.held if m not in held]
        items = [engine_ipc.SeqOutput(rid=m.rid, index=i, token_ids=[], finish_reason="abort",
                                      weight_version=self.weights.version)
                 for m in held for i in ([r.index for r in m.resume] if m.resume else range(m.params.n))]
        if items:
            self.send(engine_ipc.Outputs(items))
        return len(live) + len(items)

    def _report_finished(self) -> None:
        """Aborted requests are reported by the next step; while frozen none runs, so report now."""
        outs = self.engine.report_finished()
        items = [engine_ipc.SeqOutput(rid=o.req.group, index=o.req.index, token_ids=[], finish_reason="abort",
                                      cached_tokens=o.req.cached_tokens, weight_version=self.weights.version)
                 for o in outs]
        if items:
            self.send(engine_ipc.Outputs(items))

    def _update_weights(self, msg: engine_ipc.UpdateWeights) -> None:
        t = msg.token
        received, nonfinite = None, None
        if msg.names:  # the trainer is broadcasting now: receive first, then decide
            try:
                received, nonfinite = self.group.receive(msg.names, msg.dtypes, msg.shapes, self.beat)
            except UpdateError as e:
                self._reply(t, error=str(e), kind=e.kind)
                return
        if self.sleeping:
            self._reply(t, error=f"the engine is asleep (level {self.sleeping}); wake it up before updating weights",
                        kind="conflict")
            return
        if self._update is not None:
            self._reply(t, error="another weight update is waiting for the requests in flight; retry after it",
                        kind="conflict")
            return
        if self.paused == "keep" and self.engine.pending:
            self._reply(t, error=self._busy("weights can be updated", frozen=True), kind="conflict")
            return
        try:
            staged = self.weights.stage(msg.model_path, msg.safetensors, received, nonfinite)
        except UpdateError as e:
            self._reply(t, error=str(e), kind=e.kind)
            return
        if self.engine.pending:  # applied once they have finished on the old weights (tick)
            self._update = _Deferred(t, staged)
            return
        self._reply(t, **self._apply(staged))

    def _apply(self, staged: StagedUpdate) -> dict[str, str]:
        try:
            self.weights.apply(staged)
        except UpdateError as e:
            return {"error": str(e), "kind": e.kind}
        self.engine.reset_prefix_cache()  # NOTE: no KV of the old weights may be reused
        return {}

    def _sleep(self, msg: engine_ipc.Sleep) -> None:
        t = msg.token
        if self.sleeping:
            self._reply(t)  # (already asleep: idempotent, as vLLM's)
            return
        if self.engine.pending:
            self._reply(t, error=self._busy("the engine can sleep"), kind="conflict")
            return
        why = self.pool.refusal() or (self.weights.refusal() if msg.level == 2 else None)
        if why is not None:
            self._reply(t, error=why, kind="unsupported")
            return
        self.engine.reset_prefix_cache()  # the pool's KV is about to go: nothing may point into it
        self.engine.assert_consistent()
        if msg.level == 2:
            self.weights.release()
        released = self.pool.release()
        self.sleeping = msg.level
        self._reply(t, released=released)

    def _wake(self, token: int) -> None:
        if self.sleeping:
            self.pool.restore()
            if self.sleeping == 2:
                self.weights.reload()
                self.engine.reset_prefix_cache()
            self.sleeping = 0
        self._reply(token)

    def _busy(self, what: str, frozen: bool = False) -> str:
        n = sum(1 for r in self.engine.admission.reqs.values() if not r.finished)
        if frozen:
            return (f"{n} requests are frozen by pause mode 'keep' on weight version {self.weights.version}; "
                    "continue_generation first (they finish on those weights) or pause with mode 'abort'")
        return f"{n} requests are in flight; {what} once none is: pause with mode 'abort' or 'wait' first"

    # ------------------------------------------------------------------ answers
    def state(self) -> engine_ipc.RLState:
        return engine_ipc.RLState(weight_version=self.weights.version, paused=self.paused, sleeping=self.sleeping,
                                  in_flight=len(self.engine.admission.reqs), held=len(self.held))

    def _reply(self, token: int, error: str | None = None, kind: str = "", aborted: int = 0,
               released: int = 0) -> None:
        self.send(engine_ipc.ControlReply(token, self.state(), error, kind, aborted, released))
