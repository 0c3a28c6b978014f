"""Typed inputs and outcomes of a scheduling decision."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the conductor knows about a request when it arrives."""

    request_id: int
    input_len: int
    output_len: int
    block_hashes: tuple[int, ...]
    """Prefix-chained hash of each block of the prompt (block i stands for blocks 0..i)."""


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """Where the prefill runs and how its TTFT was predicted."""

    instance_id: int
    prefix_len: int
    """Prompt tokens whose KV is reused (local or fetched)."""
    local_prefix_len: int
    """Of those, tokens already cached on the chosen instance."""
    source_id: int | None
    """Instance the remote part of the prefix is fetched from, or None."""
    queue_s: float
    transfer_s: float
    """Seconds to get the prefix's missing part (the pool's load, or a fetch from
    `source_id`), not counting a wait for the source's NIC."""
    prefill_s: float
    wait_s: float = 0.0
    """Seconds the fetch waits for the source's NIC (busy with fetches booked before)."""

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.wait_s + self.transfer_s + self.prefill_s

    @property
    def unloaded_ttft_s(self) -> float:
        """The TTFT without the queues (the instance's and the source NIC's): what an idle
        cluster would take."""
        return self.transfer_s + self.prefill_s

    @property
    def transfer_len(self) -> int:
        return self.prefix_len - self.local_prefix_len

    @property
    def replicate(self) -> bool:
        """Hot-spot migration: a fetched prefix is kept on the chosen instance."""
        return self.source_id is not None and self.transfer_len > 0


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    instance_id: int
    tbt_s: float
    """Predicted step time once the request has joined the batch."""


@dataclass(frozen=True, slots=True)
class Accepted:
    prefill: PrefillChoice
    decode: DecodeChoice

    @property
    def predicted_ttft_s(self) -> float:
        return self.prefill.ttft_s

    @property
    def predicted_tbt_s(self) -> float:
        return self.decode.tbt_s


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str
    """'ttft' (prefill overload), 'tbt' (decode overload) or 'kv_capacity'."""
    stage: str
    """'arrival' (rejected before any work) or 'decode' (after a wasted prefill)."""
    predicted_ttft_s: float
    predicted_tbt_s: float
    prefill_load: float
    decode_load: float
    unloaded_ttft_s: float = 0.0
    """The request's own TTFT on an idle instance (transfer + prefill): above the TTFT limit,
    no wait helps."""
    ttft_limit_s: float = 0.0
    """The TTFT limit it was held to (the absolute SLO, or the relative one's value)."""
    prefix_len: int = 0
    """Prompt tokens the prefill choice it was judged on would have reused."""


Decision = Accepted | Rejected
