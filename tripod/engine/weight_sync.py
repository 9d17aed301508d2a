"""Weights from a trainer over a torch.distributed group (SGLang's ``/init_weights_update_group``
then ``/update_weights_from_distributed``): the trainer is rank 0 and broadcasts each tensor; this
engine process joins as ``rank`` and receives them (gloo on the CPU).

``WeightGroup`` owns the group of one engine process. The engine loop blocks while it joins and
while it receives (between steps, like every control), so both are bounded by ``timeout_s``, below
the server's heartbeat timeout.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch

from tripod.engine.weight_update import UPDATE_DTYPES, UpdateError

log = logging.getLogger(__name__)

DTYPES = {str(d).removeprefix("torch."): d for d in UPDATE_DTYPES}


class WeightGroup:
    """Owns this process's membership of a trainer's weight group (at most one)."""

    def __init__(self) -> None:
        self.joined = False
        self.rank = -1

    def join(self, address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the trainer's group (the trainer joins it as rank 0 at the same time)."""
        import torch.distributed as dist

        if self.joined:
            raise UpdateError("this engine has joined a weight group already", "conflict")
        if backend != "gloo":
            raise UpdateError(f"backend {backend!r}: this engine joins gloo groups (the CPU's)", "unsupported")
        if not 0 < rank < world_size:
            raise UpdateError(f"rank {rank} in a group of {world_size}: the trainer is rank 0, give 1..{world_size - 1}")
        if dist.is_initialized():
            raise UpdateError("this engine process is in a process group already (a model over several processes)",
                              "unsupported")
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise UpdateError(f"could not join the weight group at {address}:{port}: {e}") from None
        self.joined, self.rank = True, rank
        log.info("joined the weight group at %s:%d as rank %d of %d", address, port, rank, world_size)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                beat: Callable[[], None] = lambda: None) -> dict[str, torch.Tensor]:
        """Each tensor as rank 0 broadcasts it, in order (checked against the model by the caller)."""
        import torch.distributed as dist

        if not self.joined:
            raise UpdateError("no weight group: POST /init_weights_update_group first", "conflict")
        if not len(names) == len(dtypes) == len(shapes) or not names:
            raise UpdateError("give 'names', 'dtypes' and 'shapes' of the same, non-zero length")
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            raise UpdateError(f"dtype {bad[0]!r}: use one of {', '.join(DTYPES)}")
        if any(n < 0 for shape in shapes for n in shape):
            raise UpdateError("'shapes' hold a negative size")
        out: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=DTYPES[dtype])
            # NOTE: every tensor is received before any is checked: the trainer, blocked in its
            # broadcasts, is never left waiting by a refusal of a name or a shape.
            dist.broadcast(t, src=0)
            out[name] = t
            beat()  # (the loop's heartbeat while a large model arrives)
        log.info("received %d tensors over the weight group in %.2f s", len(out), time.perf_counter() - t0)
        return out
