"""The canonical trajectory record and its validation.

A worker sends one record per sample; the learner validates every field before admission and
rejects a bad record with a counted reason, never an exception that escapes the handler.

record = {
  "group_id": str,          # as handed out by the learner
  "sample_idx": int,        # 0 <= idx < group size
  "prompt_ids": [int],      # must equal the prompt the learner handed out
  "completion_ids": [int],  # generated tokens, each < vocab size, len <= max_new_tokens
  "logprobs": [float],      # behaviour log-prob of each completion token (finite, <= 0)
  "reward": float,          # finite, scored on the worker by the adapter
  "version": int,           # snapshot version the generation started with (oldest if mixed)
  "worker_id": str,
  "gen_s": float,           # seconds the worker spent generating this sample's group
}
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class RecordError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Record:
    group_id: str
    sample_idx: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    version: int
    worker_id: str
    gen_s: float = 0.0
    loss_mask: list[int] | None = None  # multi-turn: 1 on tokens the policy generated

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_new_tokens: int
    group_size: int


_FIELDS = {
    "group_id": str, "sample_idx": int, "prompt_ids": list, "completion_ids": list,
    "logprobs": list, "reward": (float, int), "version": int, "worker_id": str,
    "gen_s": (float, int),
}


def _check_ids(ids: list, vocab: int, what: str) -> None:
    for t in ids:
        if type(t) is not int:
            raise RecordError("invalid_fields", f"{what} holds {type(t).__name__}, expected int")
        if not 0 <= t < vocab:
            raise RecordError("out_of_vocab", f"{what} holds token id {t} outside [0, {vocab})")


def parse_record(obj: Any, limits: Limits) -> Record:
    """Schema, type and range checks that need no learner state."""
    if not isinstance(obj, dict):
        raise RecordError("invalid_fields", f"record is a {type(obj).__name__}, expected a map")
    extra = set(obj) - set(_FIELDS) - {"loss_mask"}
    if extra:
        raise RecordError("invalid_fields", f"unknown record fields {sorted(extra)}")
    for name, typ in _FIELDS.items():
        if name not in obj:
            raise RecordError("invalid_fields", f"record misses {name!r}")
        if not isinstance(obj[name], typ) or isinstance(obj[name], bool):
            raise RecordError("invalid_fields", f"record field {name!r} has type "
                              f"{type(obj[name]).__name__}")
    _check_ids(obj["prompt_ids"], limits.vocab_size, "prompt_ids")
    _check_ids(obj["completion_ids"], limits.vocab_size, "completion_ids")
    n = len(obj["completion_ids"])
    if not 1 <= n <= limits.max_new_tokens:
        raise RecordError("bad_length", f"{n} completion tokens, expected 1..{limits.max_new_tokens}")
    if len(obj["logprobs"]) != n:
        raise RecordError("bad_length", f"{len(obj['logprobs'])} logprobs for {n} tokens")
    for lp in obj["logprobs"]:
        if not isinstance(lp, (float, int)) or not math.isfinite(lp) or lp > 1e-4:
            raise RecordError("bad_logprob", f"behaviour log-prob {lp!r} is not finite and <= 0")
    mask = obj.get("loss_mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != n
                             or any(type(m) is not int or m not in (0, 1) for m in mask)):
        raise RecordError("bad_loss_mask", f"loss_mask must be a list of {n} ints in {{0, 1}}")
    if not math.isfinite(obj["reward"]):
        raise RecordError("non_finite_reward", f"reward {obj['reward']!r}")
    if not 0 <= obj["sample_idx"] < limits.group_size:
        raise RecordError("bad_sample_idx",
                          f"sample_idx {obj['sample_idx']} outside [0, {limits.group_size})")
    return Record(**{**obj, "reward": float(obj["reward"]), "gen_s": float(obj["gen_s"]),
                     "logprobs": [float(x) for x in obj["logprobs"]]})
