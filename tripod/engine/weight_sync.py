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
import math
import time
from collections.abc import Callable

import torch

from tripod.engine.weight_update import UPDATE_DTYPES, UpdateError, finite

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
                beat: Callable[[], None] = lambda: None) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Each tensor as rank 0 broadcasts it, in order (checked against the model by the caller),
        and the names of those holding NaN or infinities (checked as each arrives, while its
        values are still in the cache: the update reads them once less)."""
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
        nonfinite: list[str] = []
        t0 = time.perf_counter()
        for name, t in zip(names, buffers([(n, DTYPES[d], s) for n, d, s in zip(names, dtypes, shapes, strict=True)]),
                           strict=True):
            # NOTE: every tensor is received before any is checked: the trainer, blocked in its
            # broadcasts, is never left waiting by a refusal of a name or a shape.
            dist.broadcast(t, src=0)
            out[name] = t
            if not finite(t):
                nonfinite.append(name)
            beat()  # (the loop's heartbeat while a large model arrives)
        log.info("received %d tensors over the weight group in %.2f s", len(out), time.perf_counter() - t0)
        return out, nonfinite


ALIGN = 64  # bytes: where each tensor starts in its buffer (the kernels' vector width)


def buffers(specs: list[tuple[str, torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """An empty tensor for each (name, dtype, shape), in the order given. The tensors of one module
    (names alike up to their last two parts, e.g. ``model.layers.3.self_attn``) of one dtype lie
    back to back in one buffer, Q/K/V and gate/up in the order the loader fuses them whatever the
    order they are sent in: the update then takes them as views instead of copying them
    (``WeightSource``'s ``joinable_storages``). One buffer a module: a later update of a whole
    module frees its old one."""
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, (name, dtype, _) in enumerate(specs):
        groups.setdefault((name.rsplit(".", 2)[0], dtype), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(specs)
    for (_, dtype), members in groups.items():
        members.sort(key=lambda i: FUSED_ORDER.get(specs[i][0].rsplit(".", 2)[-2], len(FUSED_ORDER)))
        step = ALIGN // dtype.itemsize
        offsets, end = [], 0
        for i in members:
            end = -(-end // step) * step  # (starts aligned: no gap when sizes are multiples of ALIGN)
            offsets.append(end)
            end += math.prod(specs[i][2])
        flat = torch.empty(end, dtype=dtype)
        for i, o in zip(members, offsets, strict=True):
            out[i] = flat[o:o + math.prod(specs[i][2])].view(specs[i][2])
    return [t for t in out if t is not None]


# Where a projection goes in its module's buffer: the loader's fusions, in their order (HF names;
# Mixtral's w1/w3 are gate/up). Others follow, in the order sent.
FUSED_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 3, "up_proj": 4, "w1": 3, "w3": 4}
