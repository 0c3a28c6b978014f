"""An accelerator profile: the cost model's terms and the KV layout an emulated engine runs on,
as data (a JSON file), so the emulated and the real engine are described the same way.

    {"name": "...", "description": "...",
     "cost": {CostModel fields},           the step times (kvpool.conductor.cost)
     "chunk_overhead_s": 0.0225,           extra time of a step mixing prompt chunks and decodes
     "kv_capacity_tokens": 1000000,        KV that fits beside the weights (sets --num-blocks)
     "kv_layers": 2,                       layers the emulated KV bytes are split into
     "chunk_tokens": 512,                  chunked-prefill token budget of a step
     "calibration": {...}}                 how the decode terms were fitted (or absent)

A step's seconds come from emulated/step_cost.py, the one pricing the emulated engine and the
simulator share; `EngineProfile.step_rules` says how an engine of a kind is charged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvpool.conductor.cost import CostModel
from kvpool.engine.emulated.step_cost import PromptChunk, StepRules
from kvpool.errors import ConfigError, KvpoolError

__all__ = ["DEFAULT_PROFILE", "STEP_RULES", "DecodeCalibration", "EngineProfile", "PromptChunk",
           "StepRules", "load_profile", "scaled_cost", "write_profile"]

PROFILES_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles"
DEFAULT_PROFILE = "llama70b-8xa800"
STEP_RULES = ("kvpool", "vllm")
"""The kinds of engine a profile prices (`EngineProfile.step_rules`)."""


@dataclass(frozen=True)
class DecodeCalibration:
    """How a profile's decode terms were fitted to a paper's measurement of Mooncake
    (`kvpool sim calibrate`, kvpool.sim.calibrate): the record, not an input."""

    figure: str
    """The paper figure fitted, a key of mooncake_tbt_curves.json (e.g. fig1_conversation)."""
    trace: str
    """File name of the trace replayed."""
    base_profile: str
    """The profile whose decode terms were scaled."""
    decode_factor: float
    """Multiplier applied to the base profile's three decode-step terms."""
    decode_join_s: float
    share_rms_pp: float
    """Root mean square of (simulated - paper) share within each TBT threshold, in points."""
    share_at_ms: dict[str, float] = field(default_factory=dict)
    """Simulated Mooncake's share (percent) within each threshold, beside `paper_share_at_ms`."""
    paper_share_at_ms: dict[str, float] = field(default_factory=dict)
    tbt_ms: dict[str, float] = field(default_factory=dict)
    """Simulated p10/p50/p90 of the per-request TBT, beside `paper_tbt_ms` (when published)."""
    paper_tbt_ms: dict[str, float] = field(default_factory=dict)
    seq_factor: float | None = None
    """Multiplier of the per-sequence decode term (None: `decode_factor`, a one-factor fit)."""
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A joint fit's record per figure (trace, share_rms_pp, share_at_ms, tbt_ms and the
    paper's); the fields above then hold the first figure's."""
    neighbourhood: list[dict[str, float]] = field(default_factory=list)
    """A joint fit's terms that fit every curve within the tolerance of the best point
    (decode_factor, seq_factor, decode_join_s and each figure's share RMS): the set over
    which the experiments report their band."""


@dataclass(frozen=True)
class EngineProfile:
    name: str
    cost: CostModel = field(default_factory=CostModel)
    description: str = ""
    chunk_overhead_s: float = 0.0225
    """Extra seconds of a step that carries prompt chunks beside running decodes (the
    simulator's vLLM chunked-prefill overhead, sim/vllm.py)."""
    kv_capacity_tokens: int = 1_000_000
    """KV tokens one instance holds beside its weights."""
    kv_layers: int = 2
    """Layers the emulated KV is written and saved in (layer-wise saving overlaps the step)."""
    chunk_tokens: int = 512
    """Token budget of a chunked-prefill step (vLLM v0.5's default)."""
    calibration: DecodeCalibration | None = None

    def __post_init__(self) -> None:
        if self.chunk_overhead_s < 0:
            raise ConfigError(f"profile {self.name}: chunk_overhead_s must be >= 0, "
                              f"got {self.chunk_overhead_s}")
        for name in ("kv_capacity_tokens", "kv_layers", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"profile {self.name}: {name} must be > 0, "
                                  f"got {getattr(self, name)}")

    def step_rules(self, prefill_mode: str = "chunked", kind: str = "kvpool") -> StepRules:
        """How an engine on this profile is charged for a step (emulated/step_cost.py): `kind`
        kvpool (Mooncake's instances: a prefix is loaded beside the compute, mixed steps pay
        `chunk_overhead_s`) or vllm (the simulator's colocated vLLM v0.5.1 baseline,
        `VllmConfig.step_rules`); `prefill_mode` whole shares the prefill base in a step."""
        chunked = prefill_mode != "whole"
        if kind == "vllm":
            from kvpool.sim.vllm import VllmConfig

            return VllmConfig(chunk_overhead_s=self.chunk_overhead_s).step_rules(chunked)
        if kind != "kvpool":
            raise ConfigError(f"step rules must be one of {STEP_RULES}, got {kind!r}")
        return StepRules(shared_base=not chunked,
                         chunk_overhead_s=self.chunk_overhead_s if chunked else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> EngineProfile:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a profile is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown profile fields {unknown}; known: {sorted(known)}")
        if "name" not in data:
            raise ConfigError(f"{source}: the profile has no 'name'")
        kw = dict(data)
        try:
            kw["cost"] = CostModel.from_dict(data.get("cost") or {})
            if kw.get("calibration") is not None:
                kw["calibration"] = DecodeCalibration(**kw["calibration"])
            return cls(**kw)
        except KvpoolError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except TypeError as exc:
            raise ConfigError(f"{source}: a field has the wrong type: {exc}") from None


TIME_TERMS = ("prefill_base_s", "prefill_linear_s", "prefill_quadratic_s", "decode_base_s",
              "decode_per_seq_s", "decode_per_token_s", "transfer_latency_s", "load_s_per_token",
              "decode_join_s")


def scaled_cost(cost: CostModel, speed_up: float) -> CostModel:
    """`cost` on a clock `speed_up` times faster: every duration divided, bandwidth multiplied
    (what the proxy's conductor must predict for workers run with that speed-up)."""
    if speed_up <= 0:
        raise ConfigError(f"speed_up must be > 0, got {speed_up}")
    return replace(cost, bandwidth_gbps=cost.bandwidth_gbps * speed_up,
                   **{name: getattr(cost, name) / speed_up for name in TIME_TERMS})


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A profile by file path, or by the name of one shipped in kvpool/data/profiles."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILES_DIR / f"{name_or_path}.json"
        if not shipped.is_file():
            names = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise ConfigError(f"profile {name_or_path!r} is neither a file nor a shipped "
                              f"profile ({', '.join(names)})")
        path = shipped
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the profile {path}: {exc}") from None
    return EngineProfile.from_dict(data, str(path))


def write_profile(profile: EngineProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
