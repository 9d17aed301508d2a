"""Top-k selection whose ties are broken by position: of equal scores the lowest index wins.

``torch.topk`` leaves the order of equal values unspecified, and on the CPU it follows the
row's length and the algorithm chosen for it: an indexer row of 300 keys (a whole prefill) and
the same row of 256 (a chunk) can keep different keys when scores tie (ReLU'd indexer scores are
often exactly 0.0). Every selecting top-k in tripod (the V3.2 and V4 indexers, MoE routers,
top-k sampling, reported logprobs) goes through ``topk_by_position`` so that a selection depends
on the row's values alone: the same alone, batched, chunked, from the cache and in verify rows.

NOTE: the values are ``torch.topk``'s (they never depend on tie order); only the choice among
the values equal to the k-th is fixed here, and the result is ordered by (value descending,
index ascending). NaN scores are not expected (none of the callers produces them).
"""

from __future__ import annotations

import torch


def topk_by_position(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``x`` along the last dim, as (values, indices), ordered by
    value descending and, among equal values, by index ascending (the lowest index wins a tie)."""
    n = x.shape[-1]
    assert 0 < k <= n, f"top-k of {k} from {n}"
    if k == n:
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals, idx
    lead = x.shape[:-1]
    rows = x.reshape(-1, n)
    kth = rows.topk(k, dim=-1).values[:, -1:]  # the k-th largest value of each row
    above = rows > kth
    need = k - above.sum(dim=-1, keepdim=True)  # how many of the ties at the k-th value to take
    ties = rows == kth
    take = above | (ties & (ties.cumsum(dim=-1) <= need))  # the first `need` ties by position
    # NOTE: exactly k per row, so nonzero()'s row-major order gives each row's k in index order.
    idx = take.nonzero()[:, 1].view(-1, k)
    vals = rows.gather(1, idx)
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)  # stable: index order kept
    idx = idx.gather(1, order)
    return vals.view(*lead, k), idx.view(*lead, k)
