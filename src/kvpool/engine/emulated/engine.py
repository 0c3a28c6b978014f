"""EmulatedEngine: `EngineCore` with a profile's step times and the emulated model's KV bytes.

One step, as the torch engine's forward, layer by layer:

    rows of every token computed now  (kvbytes.token_rows; the same for every layer but a constant)
    write them into every layer's K and V at once (ByteKVCache.write_all)
    for each layer: on_layer(i) (the pool connector puts that layer's finished blocks
                    meanwhile), sleep to the layer's share of step_cost.step_s(...) / speed_up
    sample: a sequence whose last token was computed now gets output token j of the digest of
            its prompt's KV as its cache holds it (computed once per prompt completion)

The step's emulated time starts before it is scheduled, so the work of scheduling it (loading a
joining request's KV from the pool, as the accelerator's transfer engine does beside the
compute) and of writing its bytes counts toward it: a worker costs little CPU beyond the
bytes. Stamps (`StepOutput.time_s`) are where the step ends on the emulated timeline (real
clock seconds); multiply durations by `speed_up` to read them in the profile's time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.engine.blocks import prefix_block_hashes
from kvpool.engine.config import EngineConfig, ModelConfig, SamplingParams, eos_token_ids
from kvpool.engine.connector import KVConnector
from kvpool.engine.core import EngineCore, StepOutput
from kvpool.engine.emulated import kvbytes
from kvpool.engine.emulated.cache import ByteKVCache
from kvpool.engine.emulated.profile import EngineProfile
from kvpool.engine.emulated.step_cost import PromptChunk, StepRules, StepWork, step_s
from kvpool.engine.identity import KVShape, ModelIdentity, checkpoint_digest
from kvpool.engine.model_files import read_json
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.engine.sequence import KVSource, Sampled, Sequence
from kvpool.errors import CheckpointError, ConfigError, InvalidArgument

KV_FORMAT = 1
"""Version of the emulated KV bytes (kvbytes); part of the model identity."""
CATCH_UP_S = 0.005
"""A step that starts at most this long after the previous one ended starts, on the emulated
timeline, where that one ended: the loop's own work between steps (scheduling, delivery, a
late wake-up) is absorbed as long as the machine keeps up. Later than this, the time is lost
and shows in the stamps."""


def row_bytes_for(profile: EngineProfile, kv_scale: float) -> int:
    """Bytes of one token's K (or V) in one emulated layer: the profile's KV bytes per token
    times `kv_scale`, shared by 2 * kv_layers rows, in whole 8-byte words (at least one)."""
    if not 0 < kv_scale <= 1:
        raise ConfigError(f"kv_scale must be in (0, 1], got {kv_scale}")
    share = profile.cost.kv_bytes_per_token * kv_scale / (2 * profile.kv_layers)
    return max(8, int(share) // 8 * 8)


def emulated_identity(model_dir: str | Path, profile: EngineProfile, config: EngineConfig,
                      row_bytes: int) -> ModelIdentity:
    """The emulated engine's identity: the model folder's contents, the dtype and block size,
    and, since its bytes are a function of the profile's layers and row bytes, those too."""
    extra = json.dumps({"profile": profile.to_dict(), "row_bytes": row_bytes}, sort_keys=True)
    return ModelIdentity(checkpoint_digest(model_dir), config.dtype,
                         KVShape(config.block_size, profile.kv_layers, 0, 0),
                         f"emulated/{KV_FORMAT}", extra)


class EmulatedEngine(EngineCore):
    cache: ByteKVCache

    def __init__(self, profile: EngineProfile, config: EngineConfig, vocab: range,
                 root_hash: int, eos_ids: tuple[int, ...] = (), kv_scale: float = 1 / 1024,
                 speed_up: float = 1.0, connector: KVConnector | None = None,
                 clock: Clock = SYSTEM_CLOCK, rules: StepRules | None = None) -> None:
        if speed_up <= 0:
            raise ConfigError(f"speed_up must be > 0, got {speed_up}")
        row_bytes = row_bytes_for(profile, kv_scale)
        cache = ByteKVCache(profile.kv_layers, config.num_blocks, config.block_size, row_bytes)
        super().__init__(config, cache, root_hash, connector, eos_ids, clock)
        self.vocab_size = vocab.stop
        self.profile, self.vocab, self.speed_up = profile, vocab, speed_up
        self.rules = rules or profile.step_rules(config.prefill_mode)
        """How a step is charged (default: a kvpool instance in this prefill mode)."""
        self.kv_scale = 2 * profile.kv_layers * row_bytes / profile.cost.kv_bytes_per_token
        """The scale actually used (row bytes are whole words)."""
        self._constants = np.stack([kvbytes.layer_constant(layer, kind, row_bytes)
                                    for layer in range(profile.kv_layers) for kind in (0, 1)])
        """[kv_layers * 2, row_bytes]: the constant of each layer's K, then V."""
        self._digests: dict[Sequence, int] = {}
        self.emulated_s = 0.0
        """Profile seconds of every step so far (before the speed-up)."""
        self._timeline = float("-inf")
        """Where the last step ended on the emulated timeline (real clock)."""
        self._busy = False
        """Work was left when the last step ended (the next one follows it at once)."""
        self._step_called_s = 0.0
        """The clock when the current step was called (before scheduling)."""

    @classmethod
    def from_dir(cls, model_dir: str | Path, profile: EngineProfile, config: EngineConfig,
                 kv_scale: float = 1 / 1024, speed_up: float = 1.0,
                 step_rules: str = "kvpool") -> EmulatedEngine:
        """The vocabulary and EOS ids from a model folder's config.json (the proxy serves its
        tokenizer); `step_rules` names the kind of engine priced (`EngineProfile.step_rules`);
        the identity covers the folder, the profile and the KV format
        (`emulated_identity`)."""
        path = Path(model_dir) / "config.json"
        hf = read_json(path)
        try:
            vocab_size = ModelConfig.from_hf(hf).vocab_size  # bounded, as the torch engine's
        except CheckpointError:
            raise
        except ConfigError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        root = emulated_identity(model_dir, profile, config, row_bytes_for(profile, kv_scale)).root
        return cls(profile, config, kvbytes.ordinary_vocab(vocab_size), root,
                   eos_token_ids(hf), kv_scale, speed_up,
                   rules=profile.step_rules(config.prefill_mode, step_rules))

    # -- one step ------------------------------------------------------------------------------

    def step_work(self, batch: ScheduledBatch) -> StepWork:
        """What `batch` asks of the accelerator, counted as the simulator counts it: a decode's
        context is the KV it holds before the step; a decode joins when it is its first here
        with the prompt's KV from elsewhere."""
        chunks: list[PromptChunk] = []
        num_decodes = context = longest = joins = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            if n == 1 and start == len(seq.token_ids) - 1 and start >= seq.num_prompt_tokens:
                num_decodes += 1
                context += start
                longest = max(longest, start)
                joins += seq.kv_source is not KVSource.COMPUTE and start == seq.num_prompt_tokens
            else:
                reused = seq.num_cached_tokens + seq.num_pool_tokens
                first = start <= reused
                if first and seq.joins_prefilled:  # the rest of a prompt prefilled elsewhere
                    joins += 1
                    first = False
                chunks.append(PromptChunk(start, n, first=first))
        return StepWork(tuple(chunks), num_decodes, context, longest, joins)

    def step_s(self, batch: ScheduledBatch) -> float:
        """Profile seconds of `batch` (emulated/step_cost.py, as the simulator prices it)."""
        return step_s(self.profile.cost, self.rules, self.step_work(batch))

    def step(self) -> list[StepOutput]:
        self._step_called_s = self.clock.now()
        outputs = super().step()
        self._busy = self.scheduler.has_work
        return outputs

    def _start(self, now: float) -> float:
        """Where this step starts on the emulated timeline (see CATCH_UP_S); a step that
        follows a busy one late adds the delay to `lost_s`."""
        gap = now - self._timeline
        if gap <= CATCH_UP_S:
            return self._timeline
        if self._busy:
            self.lost_s += gap
        return now

    def step_end_s(self) -> float:
        return self._timeline

    def _wait(self, until: float) -> None:
        """Sleep to `until`, letting readers of the engine's state in meanwhile."""
        delay = until - self.clock.now()
        if delay <= 0:
            return
        with self.readers_in():
            self.clock.sleep(delay)

    def run(self, batch: ScheduledBatch) -> dict[Sequence, Sampled]:
        t0 = self._start(self._step_called_s)
        step = self.step_s(batch)
        self.emulated_s += step
        wall = step / self.speed_up
        self._timeline = t0 + wall
        blocks, offsets, base = self._targets(batch)
        self.connector.before_forward(batch)
        layers = self.cache.num_layers
        self.cache.write_all(blocks, offsets, base, self._constants)  # every layer, at once
        for layer in range(layers):
            self.connector.on_layer(layer)
            self._wait(t0 + wall * (layer + 1) / layers)
        self.connector.after_forward()
        done: list[Sequence] = []
        digests: list[int] = []
        positions: list[int] = []
        for seq, n in batch:  # each sequence whose last token was computed now samples
            ids = seq.token_ids
            if seq.num_computed_tokens + n == len(ids):
                done.append(seq)
                digests.append(self._digest(seq, n))
                positions.append(len(ids) - seq.num_prompt_tokens)
        tokens = kvbytes.next_tokens(digests, positions, self.vocab)
        return {seq: Sampled(token) for seq, token in zip(done, tokens, strict=True)}

    def new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                     outputs: Iterable[int] = (), **kw: Any) -> Sequence:
        if sampling.needs_logits:
            raise InvalidArgument(f"request {request_id}: the emulated engine computes no "
                                  "logits, so logprobs, penalties and logit_bias need the "
                                  "torch engine")
        return super().new_sequence(request_id, prompt, sampling, outputs, **kw)

    def _hashes(self, seq: Sequence, stop: int) -> list[int]:
        """The block hashes the bytes of `seq` derive from: its own, or for a salted request
        the unsalted ones (the same bytes as unsalted)."""
        if seq.root_hash == self.root_hash:
            return seq.block_hashes
        return prefix_block_hashes(seq.token_ids[:stop], self.config.block_size, self.root_hash)

    def _targets(self, batch: ScheduledBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the step's new KV rows go, for the whole batch: (block id, offset in the
        block, base row) of each position every sequence computes. A sequence that computes
        one token (a decode) is read as Python ints; a prompt chunk as arrays; the rows of
        all of them are made in one `kvbytes.token_rows`."""
        bs, root = self.config.block_size, self.root_hash
        blocks_of: list[int] = []
        offsets_of: list[int] = []
        parents_of: list[int] = []
        positions_of: list[int] = []
        tokens_of: list[int] = []
        """Block id, offset, parent hash, position and token of each one-token sequence, a
        list each."""
        chunks: list[tuple[np.ndarray, np.ndarray, kvbytes.RowKeys]] = []
        for seq, n in batch:
            start = seq.num_computed_tokens
            hashes = self._hashes(seq, start + n)
            if n == 1:  # kvbytes.keys_for of one position, as ints (every decode of a step)
                block = start // bs
                index = min(block, len(hashes))
                blocks_of.append(seq.block_table[block])
                offsets_of.append(start - block * bs)
                parents_of.append(hashes[index - 1] if index else root)
                positions_of.append(start)
                tokens_of.append(seq.token_ids[start])
                continue
            pos = np.arange(start, start + n)
            first, last = start // bs, (start + n - 1) // bs
            table = np.asarray(seq.block_table[first:last + 1], dtype=np.intp)
            keys = kvbytes.keys_for(seq.token_ids, start, start + n, bs, hashes, self.root_hash)
            chunks.append((table[pos // bs - first], pos % bs, keys))
        blocks = _joined(blocks_of, np.intp, [c[0] for c in chunks])
        offsets = _joined(offsets_of, np.intp, [c[1] for c in chunks])
        if not chunks:  # decodes alone: their keys as the ints they are (kvbytes.INT_WORDS)
            return blocks, offsets, kvbytes.token_rows(parents_of, positions_of, tokens_of,
                                                       self.cache.row_bytes)
        parents, positions, tokens = (_joined(col, np.uint64, [c[2][i] for c in chunks])
                                      for i, col in enumerate((parents_of, positions_of,
                                                               tokens_of)))
        return blocks, offsets, kvbytes.token_rows(parents, positions, tokens,
                                                   self.cache.row_bytes)

    def _digest(self, seq: Sequence, n: int) -> int:
        """The prompt's KV digest, whose output token j the sequence samples next (all of a
        step's at once, `kvbytes.next_tokens`); read from the cache when the prompt (or its
        recomputation) completes, or when this engine first samples for the sequence (its
        prompt KV was loaded or pushed)."""
        digest = self._digests.get(seq)
        if digest is None or n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            digest = self._digests[seq] = self._prompt_digest(seq)
        return digest

    def _prompt_digest(self, seq: Sequence) -> int:
        bs, n = self.config.block_size, seq.num_prompt_tokens
        parts = []
        for layer in range(self.cache.num_layers):
            for kind in (0, 1):
                parts += [self.cache.rows(layer, kind, seq.block_table[b // bs], min(bs, n - b))
                          for b in range(0, n, bs)]
        return kvbytes.digest_rows(parts)

    def forget(self, seq: Sequence) -> None:
        self._digests.pop(seq, None)

    # -- facts ----------------------------------------------------------------------------------

    def expected_output(self, prompt: list[int], num_tokens: int) -> list[int]:
        """What this engine must answer, from the tokens alone (kvbytes.expected_output)."""
        return kvbytes.expected_output(prompt, num_tokens, self.config.block_size,
                                       self.root_hash, self.cache.num_layers,
                                       self.cache.row_bytes, self.vocab)


def _joined(ints: list[int], dtype: type, arrays: list[np.ndarray]) -> np.ndarray:
    """`ints` as an array of `dtype`, then `arrays` after it (no concatenation for a step of
    decodes alone)."""
    head: np.ndarray = np.array(ints, dtype=dtype)
    return np.concatenate([head, *arrays]) if arrays else head
