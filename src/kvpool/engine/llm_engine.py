"""LLMEngine: the reference engine's torch half, over `core.EngineCore`.

    engine = LLMEngine.from_dir("path/to/model", EngineConfig())
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=8))
    while engine.has_work:
        for out in engine.step(): ...          # StepOutput per new token / finish

`run(batch)` is one forward of the model over the batch's tokens, writing their KV into the
paged tensor cache, and sampling where a sequence's last token was computed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpool.engine.checkpoint import DTYPES, load_model
from kvpool.engine.config import EngineConfig
from kvpool.engine.connector import KVConnector
from kvpool.engine.core import EngineCore, StepOutput
from kvpool.engine.identity import checkpoint_digest, torch_identity
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.model import AttentionBatch, CausalLM, DecodeGroup, SeqSlice
from kvpool.engine.sampler import PROMPT_ROWS, choose, logprobs_of
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.engine.sequence import Sampled, Sequence

__all__ = ["LLMEngine", "StepOutput"]


class LLMEngine(EngineCore):
    cache: KVCache

    def __init__(self, model: CausalLM, config: EngineConfig, root_hash: int = 0,
                 connector: KVConnector | None = None) -> None:
        cache = KVCache(model.config, config, DTYPES[config.dtype], config.device)
        super().__init__(config, cache, root_hash, connector, model.config.eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.model = model
        self.model_config = model.config

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig | None = None,
                 connector: KVConnector | None = None) -> LLMEngine:
        """The engine over a model folder; its chains' root is the identity of the folder's
        contents with `config`'s dtype and block size (identity.torch_identity)."""
        config = config or EngineConfig()
        model = load_model(model_dir, config.dtype, config.device)
        identity = torch_identity(checkpoint_digest(model_dir), model.config, config)
        return cls(model, config, identity.root, connector)

    def run(self, batch: ScheduledBatch) -> dict[Sequence, Sampled]:
        """One forward over the batch; returns the token sampled for each sequence whose
        last token was computed now (and adds the prompt logprobs of those that ask)."""
        ids, positions, attn, slices = self._prepare(batch)
        self.connector.before_forward(batch)
        with self.readers_in():  # the forward changes no engine state, only the KV tensors
            hidden = self.model(ids, positions, attn, self.cache.kv, self.connector.on_layer)
        self.connector.after_forward()
        for (seq, n), s in zip(batch, slices, strict=True):
            if seq.wants_prompt_logprobs:
                self.isolated(seq, self._prompt_logprobs, seq, hidden[s.start:s.start + n])
        last = [(seq, s.start + n - 1) for (seq, n), s in zip(batch, slices, strict=True)
                if seq.num_computed_tokens + n == len(seq) and not self.has_failed(seq)]
        if not last:
            return {}
        logits = self.model.logits(hidden[[row for _, row in last]])  # [N, vocab]
        picks = {seq: self.isolated(seq, choose, logits[i], seq, self.eos_ids)
                 for i, (seq, _) in enumerate(last)}
        return {seq: pick for seq, pick in picks.items() if pick is not None}

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens these rows predict (row at position p predicts the
        token at p + 1), appended to `seq.prompt_logprobs`."""
        start = seq.num_computed_tokens
        if start == 0:
            seq.prompt_logprobs.append(None)
        end = min(start + len(hidden), seq.num_prompt_tokens - 1)  # positions with a target
        k = seq.sampling.prompt_logprobs or 0
        for lo in range(start, end, PROMPT_ROWS):
            hi = min(lo + PROMPT_ROWS, end)
            logits = self.model.logits(hidden[lo - start:hi - start])
            seq.prompt_logprobs += logprobs_of(logits, seq.token_ids[lo + 1:hi + 1], k)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                       AttentionBatch, list[SeqSlice]]:
        """The flat batch: token ids [T], positions [T], where each token's KV goes, and
        each sequence's slice of it."""
        bs, dev = self.config.block_size, self.config.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        slices: list[SeqSlice] = []
        for seq, n in batch:
            start = seq.num_computed_tokens
            table = torch.tensor(seq.block_table)
            pos = torch.arange(start, start + n)                 # [n]
            slices.append(SeqSlice(len(ids), n, start + n, table.to(dev)))
            ids += seq.token_ids[start:start + n]
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)      # [n]
        attn = AttentionBatch(torch.cat(slots).to(dev),
                              [s for s in slices if s.num_new > 1], self._decode_group(slices))
        return (torch.tensor(ids, device=dev), torch.cat(positions).to(dev), attn, slices)

    def _decode_group(self, slices: list[SeqSlice]) -> DecodeGroup | None:
        ones = [s for s in slices if s.num_new == 1]
        if not ones:
            return None
        width = max(len(s.block_table) for s in ones)
        tables = torch.zeros(len(ones), width, dtype=torch.int64)
        for i, s in enumerate(ones):
            tables[i, :len(s.block_table)] = s.block_table.cpu()
        lens = [s.context_len for s in ones]
        dev, max_len = self.config.device, max(lens)
        mask = None
        if min(lens) < max_len:
            keys = torch.arange(max_len)
            mask = (keys[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].to(dev)
        return DecodeGroup(torch.tensor([s.start for s in ones], device=dev), tables.to(dev),
                           max_len, mask)
