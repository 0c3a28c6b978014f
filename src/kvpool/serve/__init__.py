"""kvpool.serve: the OpenAI-compatible proxy in front of prefill and decode workers.

Every request is tokenized here, hashed into prefix blocks, and scheduled by the same
`kvpool.conductor.Conductor` the simulator runs, over a `ClusterView` kept current from the
workers' `/load` reports. See docs/serve.md.
"""

from kvpool.serve.config import ProxyConfig

__all__ = ["ProxyConfig"]
