"""A checkpoint's tensors by name, each read only when asked for (never cached): what lets a rank
of a model over several processes hold one layer's full tensors at a time."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class LazyTensors(Mapping[str, torch.Tensor], abc.ABC):
    """``where`` maps each name to what reads it; ``read(name, handle)`` makes the tensor."""

    def __init__(self, where: dict[str, Any]) -> None:
        self._where = where

    @abc.abstractmethod
    def read(self, name: str, handle: Any) -> torch.Tensor:
        """The tensor ``name``, read through its ``handle``."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (read here; formats that store it say it without reading)."""
        return tuple(self[name].shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name, self._where[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where
