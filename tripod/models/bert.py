"""Encoder models for embeddings: the BERT family (``BertModel``) with sentence-transformers'
pooling (``1_Pooling/config.json``: cls, mean or max over the tokens; ``modules.json``: a
``Normalize`` module → unit length).

``BertEncoder`` is the whole encoder in float32: word + position + token-type embeddings and
LayerNorm, then per layer self-attention (a padding mask, so a batch of texts of different
lengths gives each text exactly what it gets alone) → dense + residual + LayerNorm → GELU MLP →
dense + residual + LayerNorm. ``load_encoder`` reads a local sentence-transformers folder
(``config.json`` with ``model_type: bert``, ``model.safetensors``). Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tripod.protocol.engine_ipc import CROSS_ENCODER_ARCHITECTURE, ENCODER_ARCHITECTURE

POOLINGS = ("cls", "mean", "max", "last")
CROSS_ENCODER = CROSS_ENCODER_ARCHITECTURE
ENCODER_ARCHITECTURES = (ENCODER_ARCHITECTURE, CROSS_ENCODER)


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A BERT checkpoint's shape, and how its sentence embedding is made."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    eps: float
    pooling: str = "mean"
    normalize: bool = False
    architecture: str = "BertModel"  # or BertForSequenceClassification (a cross-encoder: scores pairs)
    num_labels: int = 1

    @classmethod
    def from_folder(cls, path: Path) -> EncoderConfig:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") != "bert":
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not an encoder tripod reads (bert)")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {raw.get('hidden_act')!r} is not supported (gelu)")
        pooling, normalize = "cls", False
        pool_cfg = path / "1_Pooling" / "config.json"
        if pool_cfg.is_file():
            p = json.loads(pool_cfg.read_text())
            modes = [m for m, key in (("cls", "pooling_mode_cls_token"), ("mean", "pooling_mode_mean_tokens"),
                                      ("max", "pooling_mode_max_tokens"), ("last", "pooling_mode_lasttoken"))
                     if p.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{pool_cfg}: exactly one pooling mode must be on (got {modes})")
            pooling = modes[0]
        modules = path / "modules.json"
        if modules.is_file():
            normalize = any(m.get("type", "").endswith("Normalize") for m in json.loads(modules.read_text()))
        arch = (raw.get("architectures") or ["BertModel"])[0]
        if arch not in ENCODER_ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch!r} is not one tripod serves ({', '.join(ENCODER_ARCHITECTURES)})")
        labels = len(raw["id2label"]) if isinstance(raw.get("id2label"), dict) else raw.get("num_labels", 1)
        if arch == CROSS_ENCODER and labels != 1:
            raise ValueError(f"{path}: a cross-encoder with {labels} labels; tripod scores with one (a relevance logit)")
        return cls(raw["vocab_size"], raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
                   raw["intermediate_size"], raw["max_position_embeddings"], raw.get("type_vocab_size", 2),
                   raw.get("layer_norm_eps", 1e-12), pooling, normalize, arch, labels)


class BertEncoder:
    """Owns one BERT's weights (float32, read once) and turns token ids into pooled embeddings."""

    def __init__(self, config: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        prefix = "bert." if any(k.startswith("bert.") for k in weights) else ""
        self.w = {k[len(prefix):]: v.float() for k, v in weights.items() if k.startswith(prefix)}
        # A cross-encoder's head (outside the "bert." prefix): the classifier over the pooled CLS state.
        self.head = {k: v.float() for k, v in weights.items() if not k.startswith(prefix) or not prefix}
        if config.architecture == CROSS_ENCODER and "classifier.weight" not in self.head:
            raise ValueError("a BertForSequenceClassification checkpoint without classifier.weight")
        missing = [k for k in ("embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight")
                   if k not in self.w]
        if missing:
            raise ValueError(f"not a BertModel checkpoint: {', '.join(missing)} missing")

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.config.eps)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's states ``[batch, tokens, hidden]`` of padded ``ids`` (``mask`` 1 = a token;
        ``types``: token type ids, the second text of a pair 1)."""
        c, w = self.config, self.w
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos]
             + w["embeddings.token_type_embeddings.weight"][torch.zeros_like(ids) if types is None else types])
        x = self._ln(x, "embeddings.LayerNorm")
        b, t, _ = x.shape
        hd = c.hidden_size // c.num_heads
        bias = torch.zeros(b, 1, 1, t).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}"

            def heads(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, c.num_heads, hd).transpose(1, 2)

            q, k, v = (heads(self._lin(x, f"{p}.attention.self.{n}")) for n in ("query", "key", "value"))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, dim=-1) @ v
            att = att.transpose(1, 2).reshape(b, t, c.hidden_size)
            x = self._ln(self._lin(att, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            mid = F.gelu(self._lin(x, f"{p}.intermediate.dense"))
            x = self._ln(self._lin(mid, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x

    def _padded(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(len(s) > self.config.max_positions for s in batch):
            raise ValueError(f"an input is longer than the model's {self.config.max_positions} positions")
        t = max(len(s) for s in batch)
        return (torch.tensor([s + [0] * (t - len(s)) for s in batch]),
                torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in batch]))

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        """One pooled (and, as configured, normalised) embedding per token list."""
        ids, mask = self._padded(batch)
        return pool(self.hidden(ids, mask), mask, self.config.pooling, self.config.normalize).tolist()

    @torch.inference_mode()
    def score(self, batch: list[list[int]], types: list[list[int]]) -> list[float]:
        """A cross-encoder's relevance logit per pair (``batch``: each pair's ids, ``types`` its token types)."""
        ids, mask = self._padded(batch)
        tt, _ = self._padded(types)
        cls_state = self.hidden(ids, mask, tt)[:, 0]
        pooled = torch.tanh(F.linear(cls_state, self.w["pooler.dense.weight"], self.w["pooler.dense.bias"]))
        return F.linear(pooled, self.head["classifier.weight"], self.head["classifier.bias"])[:, 0].tolist()


def pool(h: torch.Tensor, mask: torch.Tensor, how: str, normalize: bool) -> torch.Tensor:
    """Token states ``[batch, tokens, hidden]`` → one vector per row (``how``: ``POOLINGS``)."""
    m = mask.unsqueeze(-1).to(h.dtype)
    if how == "cls":
        out = h[:, 0]
    elif how == "mean":
        out = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif how == "max":
        out = h.masked_fill(m == 0, float("-inf")).max(1).values
    elif how == "last":
        out = h[torch.arange(h.shape[0]), mask.sum(1) - 1]
    else:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)} (got {how!r})")
    return F.normalize(out, p=2, dim=-1) if normalize else out


def load_encoder(path: str | Path) -> BertEncoder:
    """A sentence-transformers folder → its ``BertEncoder``."""
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return BertEncoder(EncoderConfig.from_folder(folder), weights)
