"""Merging Prometheus pages of several processes (or registries) into one page.

Used where one endpoint answers for many: the multi-model router (each model's router) and the
server of a chain (every chainlet replica). Imports neither torch nor the rest of the router.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_pages(pages: Iterable[tuple[dict[str, str], str]]) -> bytes:
    """One Prometheus page from many: each page's samples get its extra labels (e.g. the replica
    they came from); samples of one metric from several pages are grouped under one family."""
    merged: dict[str, Metric] = {}
    for extra, text in pages:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue  # a page that does not parse is left out, not the whole merge
        for fam in families:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif into.type != fam.type:
                continue
            for s in fam.samples:
                into.samples.append(s._replace(labels={**s.labels, **extra}))
    registry: Any = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
