"""Weights replaced in place while the engine serves (RL rollouts: the trainer pushes each step's
policy): from a folder or GGUF file, or from HF-named tensors sent as safetensors bytes.

``WeightUpdater`` owns the engine's weight version and where its weights come from: the checkpoint
last loaded (``path``) plus the tensors sent since (``overlay``, HF names). An update is checked as
a whole first (``stage``: every name known, every shape and dtype right; a checkpoint of the same
model); nothing is applied unless all of it is valid. Applying it (``apply``) builds a fresh model
of the same class from the loader's own HF-name mapping (``load_weights``: Q/K/V and gate/up fused,
norms offset) and hands its tensors to the live model's parameters, then forgets every packed form
of the old weights (rebuilt from the new ones on the next step). The caller (``RLControl``) applies
only between steps with no request in flight, and flushes the prefix cache: one weight version per
request, and no KV of old weights reused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from tripod.loader import open_source
from tripod.loader.lazy import LazyTensors
from tripod.models.registry import model_class

if TYPE_CHECKING:
    from tripod.engine.engine import Engine

log = logging.getLogger(__name__)

# What a sent tensor may be: converted to the run dtype like a checkpoint's (FP8 or integer
# tensors would need scales or a quantization scheme the update does not carry).
UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite."""
    # NOTE: one vectorised read and no mask allocated (isfinite(t).all() is ~15x slower): min and
    # max propagate NaN, and both are finite exactly when every value is.
    return not t.numel() or all(map(math.isfinite, torch.aminmax(t.reshape(-1))))


class Layered(ChainMap[str, torch.Tensor]):
    """The tensors sent over the checkpoint's (the first mapping holding a name wins). The buffers
    the tensors sent lie in are never written again, so the loader may take fused parts lying back
    to back in one of them as a view rather than copy them (``WeightSource``'s
    ``joinable_storages``); never the checkpoint's own tensors."""

    def __init__(self, sent: dict[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> None:
        super().__init__(sent, base)  # type: ignore[arg-type]
        self.joinable_storages = frozenset(t.untyped_storage().data_ptr() for t in sent.values())


class UpdateError(ValueError):
    """An update that cannot be applied: ``kind`` "invalid" (the caller's tensors or folder: fix
    them) or "unsupported" (this engine cannot take updates at all)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass(slots=True)
class StagedUpdate:
    """A checked update waiting to be applied: the new checkpoint path (None: the current one)
    and the tensors to lay over it."""

    path: str | None
    tensors: dict[str, torch.Tensor]

    @property
    def describe(self) -> str:
        return f"folder {self.path}" if self.path is not None else f"{len(self.tensors)} tensors"


class WeightUpdater:
    """Owns the weight version of one engine and the source of its weights (checkpoint + overlay);
    swaps the live model's parameters for a fresh model's. Keeps: nothing is applied from an
    update that fails any check."""

    def __init__(self, engine: Engine, beat: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        # Called between the phases of a long update: the loop's heartbeat (it runs no step meanwhile).
        self.beat = beat
        self.version = 0
        self.path = engine.loaded.path
        self.overlay: dict[str, torch.Tensor] = {}  # HF name -> tensor sent since `path` was loaded
        self.released = False  # level-2 sleep: the parameters hold no memory until `reload`
        self._lost = False  # level-2 sleep dropped tensors sent since `path` was loaded
        self._shape_of: tuple[str, dict[str, tuple[int, ...]]] | None = None  # (path, HF name -> shape)
        self._source: tuple[str, Mapping[str, torch.Tensor]] | None = None  # (path, its tensors, lazily)

    # ------------------------------------------------------------------ checks
    def refusal(self) -> str | None:
        """Why this engine cannot take weight updates (None: it can)."""
        e = self.engine
        if e.loaded.weights == "stored":
            return ("this model runs the GGUF file's quantized blocks as stored (--weights stored): new weights "
                    "would have to be quantized into those blocks; serve it with the default dequantized weights "
                    "to update it")
        if e.loaded.weights == "fp8":
            return ("this model keeps its block-wise FP8 weights (--weights fp8): new weights would need FP8 scales; "
                    "serve it with the default dequantized weights to update it")
        if e.group is not None:
            return "this model runs over several processes (tensor/pipeline parallel): in-place updates are not built for it"
        from tripod.memory.tiered_cache import TieredCache

        if isinstance(e.cache, TieredCache):
            return ("this engine keeps a disk KV tier keyed by the weights it started with (--kv-disk): "
                    "serve it without --kv-disk to update weights")
        return None

    def stage(self, model_path: str = "", safetensors: bytes = b"",
              tensors: dict[str, torch.Tensor] | None = None, nonfinite: list[str] | None = None) -> StagedUpdate:
        """Check an update (``UpdateError`` saying what is wrong; nothing applied), ready to apply:
        a checkpoint path, safetensors bytes, or tensors already received (a weight group's; with
        ``nonfinite``, the names of those holding NaN or infinities, checked as they arrived)."""
        why = self.refusal()
        if why is not None:
            raise UpdateError(why, "unsupported")
        if (bool(model_path) + bool(safetensors) + (tensors is not None)) != 1:
            raise UpdateError("give exactly one of a model path, safetensors bytes or tensors")
        if model_path:
            return StagedUpdate(self._check_source(model_path), {})
        if tensors is None:
            tensors = self._parse(safetensors)
        return StagedUpdate(None, self._check_tensors(tensors, nonfinite))

    def _check_source(self, model_path: str) -> str:
        try:
            _, path, src = open_source(model_path)
            cfg = src.config()
        except ValueError as e:
            raise UpdateError(str(e)) from None
        live = self.engine.model_config
        diff = [f.name for f in dataclasses.fields(live) if getattr(cfg, f.name) != getattr(live, f.name)]
        if diff:
            raise UpdateError(f"{path} is not a checkpoint of the served model: its config differs in "
                              f"{', '.join(diff[:6])}; give a checkpoint of the same architecture and shape")
        return str(path)

    @staticmethod
    def _parse(data: bytes) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as load_safetensors

        try:
            return load_safetensors(data)
        except Exception as e:  # safetensors raises its own SafetensorError (and others) on bad bytes
            raise UpdateError(f"the body is not a safetensors file ({type(e).__name__}: {e})") from None

    def _check_tensors(self, sent: dict[str, torch.Tensor], nonfinite: list[str] | None) -> dict[str, torch.Tensor]:
        if not sent:
            raise UpdateError("the update holds no tensors")
        base = self._shapes()
        for name, t in sent.items():
            if name not in base:
                raise UpdateError(f"tensor {name!r} is not a weight of this model (HF names, as in its checkpoint: "
                                  f"e.g. {next(iter(base))!r})")
            if t.dtype not in UPDATE_DTYPES:
                raise UpdateError(f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')}; send float32, "
                                  "bfloat16 or float16")
            want = base[name]
            if tuple(t.shape) != want:
                raise UpdateError(f"tensor {name!r} has shape {list(t.shape)}; this model's is {list(want)}")
        # (a weight group's receiver checked each tensor as it arrived, while in the cache)
        bad = nonfinite if nonfinite is not None else [name for name, t in sent.items() if not finite(t)]
        if bad:
            raise UpdateError(f"tensor {bad[0]!r} holds NaN or infinite values")
        return sent

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The current checkpoint's tensor shapes by HF name (read once per checkpoint)."""
        if self._shape_of is None or self._shape_of[0] != self.path:
            base = self._base(self.path)
            # (a lazy checkpoint says its shapes without reading, or dequantizing, its tensors)
            shape = base.shape if isinstance(base, LazyTensors) else lambda name: tuple(base[name].shape)
            self._shape_of = (self.path, {name: shape(name) for name in base})
        return self._shape_of[1]

    def _base(self, path: str) -> Mapping[str, torch.Tensor]:
        """The checkpoint at ``path`` by HF name, each tensor read only when the load asks for it
        (a full update reads none); opened once per path."""
        if self._source is None or self._source[0] != path:
            _, _, src = open_source(path)
            lazy = src.lazy_weights()
            self._source = (path, lazy if lazy is not None else src.weights())
        return self._source[1]

    # ------------------------------------------------------------------ applying
    def apply(self, update: StagedUpdate) -> int:
        """Lay ``update`` into the live model (between steps, no request in flight); returns the new
        version. The caller flushes the prefix cache."""
        path = update.path if update.path is not None else self.path
        overlay = {} if update.path is not None else {**self.overlay, **update.tensors}
        if update.path is not None:  # (read afresh: a trainer may rewrite the same folder each step)
            self._source = self._shape_of = None
        self._load(path, overlay)
        self.path, self.overlay = path, overlay
        self.version += 1
        log.info("weights updated from %s: version %d", update.describe, self.version)
        return self.version

    def _load(self, path: str, overlay: dict[str, torch.Tensor]) -> None:
        e = self.engine
        live = e.loaded.model
        t0 = time.perf_counter()
        base = self._base(path)
        fresh = model_class(e.model_config.architecture)(e.model_config, e.dtype, e.device)
        self.beat()
        try:
            fresh.load_weights(Layered(overlay, base) if overlay else base)
        except ValueError as err:
            raise UpdateError(f"{path}: {err}") from None
        self.beat()
        new = dict(fresh.named_parameters(remove_duplicate=False))
        old = dict(live.named_parameters(remove_duplicate=False))
        if new.keys() != old.keys():
            raise UpdateError(f"{path} does not load into the served model's parameters")
        for name, p in old.items():
            if not self.released and p.shape != new[name].shape:
                raise UpdateError(f"{path}: weight {name} has shape {list(new[name].shape)}, the served one "
                                  f"{list(p.shape)}")
        self.release_forms()
        for name, p in old.items():
            # NOTE: the loader itself sets `.data`; tied weights stay tied (the fresh model ties
            # them the same way) and every holder of these Parameter objects (a self-speculative
            # draft's view, LoRA) sees the new tensors.
            p.data = new[name].data
        self.released = self.engine.runner.weights_released = False
        t1 = time.perf_counter()
        # The packed forms of the new weights built now (not on the first request after the
        # update, which would then wait for them): the update's cost, not a rollout's.
        _ = self.engine.runner.backend
        log.info("weights swapped in %.2f s, packed for the kernels in %.2f s", t1 - t0,
                 time.perf_counter() - t1)

    def release_forms(self) -> None:
        """Forget every packed copy of the weights (oneDNN/kernel layouts): rebuilt on the next step."""
        model = self.engine.loaded.model
        for form in list(model.head_ops):
            model.release(form)

    # ------------------------------------------------------------------ level-2 sleep
    def release(self) -> None:
        """Give the weights' memory back (level-2 sleep): every parameter made empty."""
        self.engine.runner.weights_released = True
        self.release_forms()
        for p in self.engine.loaded.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # The tensors sent are dropped too: waking reloads the checkpoint as it is on disk.
        self._lost, self.overlay = bool(self.overlay), {}
        self.released = True

    def reload(self) -> int:
        """Load the checkpoint again after ``release``; the version moves on only if tensors sent
        since it was loaded are lost (the weights then differ from the version before the sleep)."""
        self._source = self._shape_of = None  # (the checkpoint as it is on disk now)
        self._load(self.path, {})
        if self._lost:
            self.version += 1
            self._lost = False
        return self.version
