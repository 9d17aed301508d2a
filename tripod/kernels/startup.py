"""How an engine (or a worker rank) starts on the kernels: refuse a forced level this CPU lacks,
load them or start their build, and serve on one thread fewer while a build holds a core."""

from __future__ import annotations

import torch

from tripod import kernels
from tripod.config import EngineConfig


def start_kernels(config: EngineConfig, path: str, device: torch.device, wait: bool | None = None) -> None:
    """Refuse a forced kernel level this CPU lacks; load (or start building) the kernels
    (``wait``: whether to wait for the build; by default only when asked for explicitly)."""
    level = config.kernel_level
    if level is not None:
        why = kernels.unavailable_reason(level)
        if why is not None:
            raise ValueError(f"--kernels {level} cannot run here: {why}; use --kernels optimized (the best level "
                             f"this CPU supports: {kernels.best_level() or 'none'}) or eager")
    if path == "optimized" and device.type == "cpu":
        # "optimized", a level or stored weights asked for explicitly: wait for the kernels'
        # build (tests, benchmarks); under "auto" serve on torch's ops while it builds in
        # the background, and switch when it is loaded.
        kernels.load(level, wait=config.kernels != "auto" or config.weights == "stored" if wait is None else wait)


class BuildThreads:
    """While the kernels build in the background the compiler holds a core; a parallel region whose
    thread shares that core waits for it at every barrier (10x slower steps on 2 cores), so the
    engine serves on one thread fewer until the build ends."""

    def __init__(self) -> None:
        self.after: int | None = None
        if kernels.building() and torch.get_num_threads() > 1:
            self.after = torch.get_num_threads()
            torch.set_num_threads(self.after - 1)

    def restore_when_built(self) -> None:
        if self.after is not None and not kernels.building():
            torch.set_num_threads(self.after)  # the build is over
            self.after = None
