"""A decoder served as an embedder (``tripod serve --task embed``): pooled final hidden states
instead of generated tokens.

Each input of an ``EmbedRequest`` becomes one engine ``Req`` that the scheduler runs like any
other prefill: batched with the others waiting, chunked by ``--chunk-size`` and the step's token
budget. Nothing is sampled: ``ModelRunner`` hands every forward's last-layer states to the
``Pooler``, which folds each pooled request's rows into its ``PoolState`` (a running sum for
``mean``, the first row for ``cls``, the prompt's last row for ``last``), after the model's own
final norm, as Hugging Face's ``AutoModel(...).last_hidden_state`` is. A request whose prompt is
all computed is finished at once (``engine/embed_queue.py``), its KV released; an embedding engine
keeps no prefix cache (a cached prefix would not be recomputed, so its states could not be pooled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tripod.layers.batch import ForwardBatch

POOLINGS = ("last", "mean", "cls")


@dataclass(slots=True)
class PoolState:
    """What has been pooled of one request's prompt so far (float32), and the vector once done."""

    total: torch.Tensor | None = None  # mean: the sum of the rows seen; cls / last: the row
    rows: int = 0
    vector: list[float] | None = None


class Pooler:
    """Folds the pooled requests' rows of each forward into their ``PoolState``s (``how``:
    ``POOLINGS``; ``normalize``: L2-normalise the pooled vector). Owns no request: it reads the
    batch's ``item_rows`` and the model's captured last-layer states."""

    def __init__(self, model: Any, how: str, normalize: bool) -> None:
        if how not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)} (got {how!r})")
        self.model, self.how, self.normalize = model, how, normalize
        model.capture_hidden = True  # NOTE: every forward keeps its last layer's output ([T, H], before the norm)

    def collect(self, batch: ForwardBatch) -> None:
        hidden = self.model.last_hidden
        assert hidden is not None and not batch.micro and batch.dp is None, "pooling runs on one process"
        for it, first in batch.item_rows:
            state = it.req.pooled
            if state is None:
                continue
            n_prompt = len(it.req.prompt_ids)
            end = it.start + it.length == n_prompt
            if self.how == "mean":
                rows = self._normed(hidden[first : first + it.length], batch)
                s = rows.sum(0)
                state.total = s if state.total is None else state.total + s
                state.rows += it.length
            elif self.how == "cls" and it.start == 0:
                state.total, state.rows = self._normed(hidden[first : first + 1], batch)[0], 1
            elif self.how == "last" and end:
                state.total, state.rows = self._normed(hidden[first + it.length - 1 : first + it.length], batch)[0], 1
            if end:
                assert state.total is not None and (self.how != "mean" or state.rows == n_prompt)
                v = state.total / state.rows if self.how == "mean" else state.total
                state.vector = (F.normalize(v, p=2, dim=-1) if self.normalize else v).tolist()

    def _normed(self, rows: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The model's final norm over ``rows`` (the step's backend, as the logits get it), in float32."""
        m = self.model
        return batch.backend.norm(rows.contiguous(), m.norm, m.cfg.rms_norm_eps).float()
