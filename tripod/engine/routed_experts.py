"""Routed experts per token (``return_routed_experts``, for routing replay in RL).

``RoutingCapture`` owns the capture: on a step where a running request asked for its routing, every
routed-experts layer (``layers/moe.MoE``) of the model appends the step's expert ids ``[T, k]`` to
a list; after the forward each asking request takes its own rows (``batch.item_rows``) into
``Req.routed``, indexed by position. Routing is computed per row, so a request's ids do not depend
on what else ran in the step (alone = batched).

Positions, not arrival order: a row recomputed (a retracted request's prompt, a speculative or
jump-forward position that was rejected and computed again) overwrites its entry, and the answer
keeps the positions the request computed: the prompt and every output token but the last (a token
is routed when it is fed back, a step after it was sampled; the last one is never fed back).
Such a request never takes a cached prefix (``Scheduler._match``): its prompt is routed here.
"""

from __future__ import annotations

from typing import Any

import torch

from tripod.layers.moe import MoE


class RoutingCapture:
    """The model's routed-experts layers and the per-step capture of their expert ids."""

    def __init__(self, model: Any) -> None:
        """``model`` None: a runner that never reports routing (a draft model's)."""
        # The decoder's layers only: an MTP head's MoE (speculative drafts) runs outside the step's forward.
        body = getattr(model, "layers", model)
        self.layers: list[MoE] = [] if model is None else [m for m in body.modules() if isinstance(m, MoE)]
        self._active = False

    def refusal(self, multi_process: bool) -> str | None:
        """Why this engine cannot return routed experts (None: it can)."""
        if not self.layers:
            return ("return_routed_experts needs a mixture-of-experts model; this model has no routed-experts "
                    "layers (or routes with its own router, which tripod does not report yet)")
        if multi_process:
            return "return_routed_experts runs on a model served by one process (no tensor, pipeline or expert parallelism)"
        return None

    def begin(self, batch: Any) -> bool:
        """Arm the layers when a request of ``batch`` asked for its routing; whether it did."""
        self._active = bool(self.layers) and any(it.req.routed is not None for it, _ in batch.item_rows)
        for m in self.layers:
            m.routed = [] if self._active else None
        return self._active

    def collect(self, batch: Any) -> None:
        """File each asking request's rows of this step by position, then disarm the layers."""
        if not self._active:
            return
        per_layer = [m.routed for m in self.layers]
        for m in self.layers:
            m.routed = None
        self._active = False
        assert all(p is not None and len(p) == 1 for p in per_layer), "one routing per layer and step"
        ids = torch.stack([p[0] for p in per_layer], dim=1).cpu()  # type: ignore[index]  # [T, L, k]
        for it, first in batch.item_rows:
            routed = it.req.routed
            if routed is None:
                continue
            rows = ids[first : first + it.length].tolist()
            end = it.start + it.length
            if len(routed) < end:
                routed.extend([None] * (end - len(routed)))
            routed[it.start : end] = rows


def finished_routing(req: Any) -> list[list[list[int]]] | None:
    """The routing of the positions ``req`` computed: its prompt and all output tokens but the last."""
    if req.routed is None:
        return None
    n = len(req.prompt_ids) + max(len(req.output_ids) - 1, 0)
    out = req.routed[:n]
    assert len(out) == n and all(r is not None for r in out), "every computed position was routed"
    return out
