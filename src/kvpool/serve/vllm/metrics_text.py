"""vLLM's Prometheus `/metrics` text -> the load the conductor reads. Sans-I/O.

    vllm:num_requests_running        gauge, one sample per engine (data-parallel rank)
    vllm:num_requests_waiting        gauge
    vllm:kv_cache_usage_perc         gauge, 0..1 (vllm:gpu_cache_usage_perc in older versions)
    vllm:cache_config_info           info gauge (value 1); its labels carry block_size,
                                     num_gpu_blocks, prefix_caching_hash_algo,
                                     enable_prefix_caching

Counts are summed over engines and the KV usage averaged; or, for one data-parallel rank named
as an instance (serve/vllm/ranks.py), its engine's samples alone (label `engine`). The block
count is the server's already: its API server adds up its engines' blocks into one cache
config and writes that config into every engine's cache_config_info series, so a rank's share
is the count over the number of those series. A sample that is not a finite number, or a
label that is not a decimal count, is read as absent. A text without a single `vllm:` sample
is not a vLLM's: `parse_metrics` returns None.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_READ = ("vllm:num_requests_running", "vllm:num_requests_waiting", *KV_USAGE_NAMES,
         "vllm:cache_config_info")
METRICS_PATH = "/metrics?" + "&".join(f"name[]={name}" for name in _READ)
"""The scrape the backend makes: Prometheus's own `name[]` filter (vLLM serves /metrics
through prometheus_client), so an instance renders, and the proxy reads, these five samples
and not every histogram (about 1 KB instead of 72 KB a poll). A server that ignores the filter
sends everything; the parse reads the same names either way."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    """Share of the KV cache in use, 0..1 (mean over engines)."""
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    """--prefix-caching-hash-algo, where the version reports it."""

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


def _labels(text: str | None) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\")
            for k, v in _LABEL.findall(text or "")}


def _int(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isascii() and value.isdigit() else None


def parse_metrics(text: str, engine: str | None = None) -> EngineMetrics | None:
    """The engine's load (of every engine, or of the one labelled `engine`), or None when
    `text` holds no vLLM sample (of that engine)."""
    running = waiting = 0.0
    seen = False
    usages: list[float] = []
    configs: dict[str, dict[str, str]] = {}  # cache_config_info's labels, by engine
    if "\nvllm:" not in text and not text.startswith("vllm:"):
        return None
    for line in text.splitlines():
        if not line.startswith(_READ):  # (a vLLM's text is ~70 KB; four names are read)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, raw_labels, raw = m.groups()
        labels = _labels(raw_labels)
        if name == "vllm:cache_config_info":  # every engine's: their number divides blocks
            configs[labels.get("engine", "")] = labels
        if engine is not None and labels.get("engine", engine) != engine:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        seen = True
        if name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name in KV_USAGE_NAMES:
            usages.append(value)
    if not seen:
        return None
    info = configs.get(engine if engine is not None else "", next(iter(configs.values()), {}))
    blocks = _int(info, "num_gpu_blocks")
    if blocks is not None and engine is not None:
        blocks //= max(1, len(configs))
    return EngineMetrics(int(running), int(waiting),
                         sum(usages) / len(usages) if usages else 0.0,
                         _int(info, "block_size"), blocks,
                         info.get("prefix_caching_hash_algo") or None)
