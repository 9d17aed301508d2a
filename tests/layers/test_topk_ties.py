"""``topk_by_position``: ties broken by position (the lowest index wins), whatever the row's length
or the batch around it; and the sampler's top-k / logprobs built on it."""

from __future__ import annotations

import torch

from tripod.engine.request import Req, SamplingParams
from tripod.engine.sampler import Sampler
from tripod.layers.moe import MoEConfig, route
from tripod.layers.topk import topk_by_position


def test_ties_go_to_the_lowest_index_at_every_length() -> None:
    for n in (5, 17, 256, 300, 4099):  # lengths where torch.topk picks different algorithms
        row = torch.zeros(n)
        row[n // 2] = 1.0  # one clear winner, the rest an exact tie at 0.0
        vals, idx = topk_by_position(row, 4)
        assert idx.tolist() == [n // 2, *[i for i in range(4) if i != n // 2][:3]]
        assert vals.tolist() == [1.0, 0.0, 0.0, 0.0]
        vals, idx = topk_by_position(torch.zeros(n), 3)
        assert idx.tolist() == [0, 1, 2]


def test_duplicated_scores_and_masked_tails() -> None:
    x = torch.tensor([[0.5, 2.0, 0.5, 2.0, 0.5, -1.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    vals, idx = topk_by_position(x, 3)
    assert idx.tolist() == [[1, 3, 0], [0, 1, 2]]
    assert vals.tolist() == [[2.0, 2.0, 0.5], [3.0, 3.0, 3.0]]
    # A row padded with -inf (an indexer's invisible keys) selects as the unpadded row does.
    short = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    padded = torch.cat([short, torch.full((400,), float("-inf"))])
    assert topk_by_position(short, 3)[1].tolist() == topk_by_position(padded, 3)[1].tolist() == [2, 0, 1]
    # Batched rows select as each row alone does.
    rows = torch.stack([padded, torch.zeros(405), torch.arange(405.0) % 3])
    for r in range(3):
        assert topk_by_position(rows, 7)[1][r].tolist() == topk_by_position(rows[r], 7)[1].tolist()


def test_router_ties_pick_the_lowest_experts() -> None:
    spec = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, scoring="softmax")
    w, idx = route(torch.zeros(3, 8), spec, None)
    assert idx.tolist() == [[0, 1]] * 3 and torch.allclose(w, torch.full((3, 2), 0.5))
    grouped = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, scoring="sigmoid", topk_method="group_top2",
                        n_group=4, topk_group=2)
    logits = torch.zeros(2, 8)
    logits[1, 7] = 1.0  # group 3 wins outright; of the tied groups the lowest joins it
    _, idx = route(logits, grouped, torch.zeros(8))
    assert idx.tolist() == [[0, 1], [7, 0]]


def _req(**params: object) -> Req:
    return Req(prompt_ids=[0], params=SamplingParams(**params))  # type: ignore[arg-type]


def test_top_k_sampling_keeps_exactly_k_by_position() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    sampler = Sampler(torch.device("cpu"))
    reqs = [_req(temperature=1.0, top_k=2), _req(temperature=1.0, top_k=3)]
    probs = sampler.probs(logits, reqs)
    assert (probs[0] > 0).tolist() == [False, True, True, False, False, False]
    assert (probs[1] > 0).tolist() == [True, True, True, False, False, False]
    alone = sampler.probs(logits[1:], reqs[1:])  # the same row alone: the same distribution
    assert torch.equal(alone[0], probs[1])
    tokens = sampler.sample(logits, [_req(temperature=0.0, logprobs=3), _req(temperature=0.0, logprobs=3)])
    assert [t for t, _ in tokens.logprobs[0].top] == [1, 2, 3]
    assert [t for t, _ in tokens.logprobs[1].top] == [0, 1, 2]
