"""The canonical trajectory record and its validation.

A worker sends one record per sample; the learner validates every field before admission and
rejects a bad record with a counted reason, never an exception that escapes the handler.

record = {
  "group_id": str,          # as handed out by the learner
  "sample_idx": int,        # 0 <= idx < group size
  "prompt_ids": [int],      # must equal the prompt the learner handed out
  "completion_ids": [int],  # generated tokens, each < vocab size, len <= max_new_tokens
  "logprobs": [float],      # behaviour log-prob of each completion token (finite, in
                            # [min_logprob, 0]; masked tokens too)
  "reward": float,          # finite, |reward| <= max_abs_reward; scored on the worker
  "version": int,           # snapshot version the generation started with (oldest if mixed)
  "worker_id": str,
  "gen_s": float,           # seconds the worker spent generating this sample's group (>= 0)
  "loss_mask": [int],       # optional, multi-turn: 1 on tokens the policy generated
  "versions": [[v, count]], # optional: the snapshot version of each completion token as runs,
                            # oldest first; a sample continued after a preemption has two or
                            # more (docs/preemption.md). Absent: every token is ``version``.
  "stats": {str: float},    # optional, multi-turn: the episode's numbers from
                            # ``EpisodeSample.info``, at most 16, names [a-z][a-z0-9_]{0,31},
                            # finite, |x| <= 1e15. Shown as step means, never trained on.
  "cut": bool,              # optional, multi-turn: the episode stopped at a limit (counted in
                            # the step row's completions_cut, nothing else)
}

Every number is bounded here, at admission, so that nothing a worker can send overflows or
turns into NaN downstream (advantages, the loss, metrics): with |reward| <= max_abs_reward
(at most 1e30, ``echo_rl.core.config``) the group advantages are finite, and a log-prob floor keeps
``exp(logp_old - logp_behaviour)`` and float32 conversion away from infinity.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from echo_rl.core.errors import ReasonError
from echo_rl.core.jsontypes import JsonObject


class RecordError(ReasonError, ValueError):
    """A delivered record refused by the learner (counted by ``reason``)."""


@dataclass(frozen=True)
class Record:
    """One sample as a worker delivered it and the learner admitted it."""

    group_id: str  # as handed out by the learner
    sample_idx: int  # 0 <= idx < group size
    prompt_ids: list[int]  # equal to the Prompt's prompt_ids handed out
    completion_ids: list[int]  # generated tokens (multi-turn: the transcript after the prompt)
    logprobs: list[float]  # behaviour log-prob per completion token (0.0 on environment tokens)
    reward: float  # reward() or EpisodeSample.reward, scored on the worker
    version: int  # snapshot version the generation started with (oldest if mixed)
    worker_id: str  # who sent it
    gen_s: float = 0.0  # seconds the worker spent generating its group
    loss_mask: list[int] | None = None  # multi-turn: 1 on tokens the policy generated
    versions: list[list[int]] | None = None  # [version, count] runs (None: all ``version``)
    # multi-turn: the episode's numeric ``info`` under its names (the worker's word: shown as
    # step means, never trained on nor used in a decision); None: none sent
    stats: dict[str, float] | None = None
    # multi-turn: the episode stopped at a limit, as the worker judged it (completions_cut)
    cut: bool | None = None

    def to_wire(self) -> JsonObject:
        """The record as the dict a worker sends (msgpack)."""
        return asdict(self)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_new_tokens: int
    group_size: int
    max_abs_reward: float = 1e6  # learner.max_abs_reward
    min_logprob: float = -1e4  # learner.min_behaviour_logprob
    # the adapter's answer_tokens (echo_rl/data/answers.py): every trained token must be one
    answer_tokens: frozenset[int] | None = None


# log-probs a hair above 0 are rounding in the worker's sampler, not probabilities above 1
LOGPROB_TOLERANCE = 1e-4

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "group_id": str,
    "sample_idx": int,
    "prompt_ids": list,
    "completion_ids": list,
    "logprobs": list,
    "reward": (float, int),
    "version": int,
    "worker_id": str,
    "gen_s": (float, int),
}


# Optional fields: absent (or None) in records of older workers, and of single-turn samples.
_OPTIONAL = ("loss_mask", "versions", "stats", "cut")

# An episode's numbers that travel (``EpisodeSample.info`` -> the record's ``stats``): at most
# MAX_STATS, each under a short identifier, finite and within MAX_ABS_STAT (so that a step's
# mean of them stays finite). Everything else in ``info`` stays on the worker.
STAT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_STATS = 16
MAX_ABS_STAT = 1e15


def stat_number(value: object) -> float | None:
    """``value`` as a stat (bool -> 0.0/1.0; a finite int or float within +-MAX_ABS_STAT), else
    None."""
    if not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) and abs(x) <= MAX_ABS_STAT else None


def episode_stats(info: object) -> tuple[dict[str, float], list[str]]:
    """The numbers of an episode's ``info`` that travel as the record's ``stats``, in
    ``info``'s order, and the names of numbers that cannot (a name that is no short identifier,
    a value that is not finite or out of range, more than MAX_STATS). Values that are not
    numbers (text, lists, dicts: the adapter's logs) are neither: they stay on the worker."""
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for key, value in info.items() if isinstance(info, dict) else ():
        if not isinstance(value, (int, float)):  # free-form: the adapter's own
            continue
        x = stat_number(value)
        ok = isinstance(key, str) and STAT_NAME.fullmatch(key) is not None
        if x is None or not ok or len(kept) >= MAX_STATS:
            dropped.append(str(key)[:40])
        else:
            kept[key] = x
    return kept, dropped


def check_stats(stats: object) -> dict[str, float]:
    """A record's ``stats`` as the learner admits them, or ``RecordError("bad_stats")``."""
    if not isinstance(stats, dict) or len(stats) > MAX_STATS:
        raise RecordError("bad_stats", f"stats must be a map of at most {MAX_STATS} numbers")
    out = {}
    for key, value in stats.items():
        if not isinstance(key, str) or STAT_NAME.fullmatch(key) is None:
            raise RecordError(
                "bad_stats", f"stat name {str(key)[:40]!r} is not [a-z][a-z0-9_]{{0,31}}"
            )
        x = None if isinstance(value, bool) else stat_number(value)
        if x is None:
            raise RecordError(
                "bad_stats",
                f"stat {key!r} is {str(value)[:40]!r}: a finite number within "
                f"+-{MAX_ABS_STAT:g} is expected",
            )
        out[key] = x
    return out


def _check_ids(ids: list[object], vocab: int, what: str) -> None:
    for t in ids:
        if type(t) is not int:
            raise RecordError("invalid_fields", f"{what} holds {type(t).__name__}, expected int")
        if not 0 <= t < vocab:
            raise RecordError("out_of_vocab", f"{what} holds token id {t} outside [0, {vocab})")


def _check_logprobs(logprobs: list[object], floor: float) -> None:
    """Every token, trained on or not: a masked -1e39 becomes -inf in float32, and -inf times
    a zero mask is NaN."""
    for lp in logprobs:
        if not isinstance(lp, (float, int)) or isinstance(lp, bool):
            raise RecordError(
                "invalid_fields", f"logprobs hold {type(lp).__name__}, expected float"
            )
        lp = _as_float(lp, "non_finite_logprob")
        if not math.isfinite(lp):
            raise RecordError("non_finite_logprob", f"behaviour log-prob {lp!r} is not finite")
        if lp > LOGPROB_TOLERANCE:
            raise RecordError("bad_logprob", f"behaviour log-prob {lp!r} is above 0")
        if lp < floor:
            raise RecordError(
                "logprob_below_floor",
                f"behaviour log-prob {lp!r} is below the floor {floor:g}; a sampled "
                f"token cannot be this unlikely (learner.min_behaviour_logprob)",
            )


def _as_float(x: float | int, reason: str) -> float:
    """An int too large for a float (possible in-process, not over msgpack) is out of range,
    not an OverflowError."""
    try:
        return float(x)
    except OverflowError:
        raise RecordError(reason, f"{x!r} does not fit a float") from None


def _check_reward(reward: float | int, bound: float) -> None:
    reward = _as_float(reward, "reward_out_of_range")
    if not math.isfinite(reward):
        raise RecordError("non_finite_reward", f"reward {reward!r}")
    if abs(reward) > bound:
        raise RecordError(
            "reward_out_of_range",
            f"reward {reward!r} is outside [-{bound:g}, {bound:g}]: scale the "
            f"adapter's rewards down, or raise learner.max_abs_reward (at most 1e30)",
        )


MAX_VERSION_RUNS = 64


def check_versions(runs: object, n: int, oldest: int) -> None:
    """Per-token versions as ``[version, count]`` runs: counts >= 1 summing to ``n``, adjacent
    runs of different versions, and ``oldest`` (the record's ``version``, which the staleness
    rule judges) the smallest. Runs need not increase: a worker that continues a sample may
    hold an older snapshot than the one that started it."""
    if not (
        isinstance(runs, list)
        and 1 <= len(runs) <= MAX_VERSION_RUNS
        and all(
            isinstance(r, (list, tuple))
            and len(r) == 2
            and all(type(x) is int for x in r)
            and r[1] >= 1
            for r in runs
        )
    ):
        raise RecordError(
            "bad_versions",
            f"versions must be 1..{MAX_VERSION_RUNS} [version, "
            f"count] pairs of ints with count >= 1",
        )
    if sum(r[1] for r in runs) != n:
        raise RecordError(
            "bad_versions",
            f"versions cover {sum(r[1] for r in runs)} tokens, the completion has {n}",
        )
    vs = [r[0] for r in runs]
    if min(vs) != oldest or any(b == a for a, b in zip(vs, vs[1:])):
        raise RecordError(
            "bad_versions",
            f"versions {vs[:8]}: adjacent runs must differ and the "
            f"oldest must be the record's version {oldest}",
        )


def _check_answers(ids: list[int], mask: list[int] | None, allowed: frozenset[int]) -> None:
    """The policy's tokens (all, or the loss-masked ones of an episode) are allowed answers:
    a worker that samples outside the adapter's set is not running the run's sampler."""
    bad = [t for t, m in zip(ids, mask or [1] * len(ids)) if m and t not in allowed]
    if bad:
        raise RecordError(
            "bad_answer_token",
            f"trained tokens {sorted(set(bad))[:8]} are not "
            f"among the adapter's answer tokens {sorted(allowed)[:16]}",
        )


def parse_record(obj: object, limits: Limits) -> Record:
    """Schema, type and range checks that need no learner state."""
    if not isinstance(obj, dict):
        raise RecordError("invalid_fields", f"record is a {type(obj).__name__}, expected a map")
    extra = set(obj) - set(_FIELDS) - set(_OPTIONAL)
    if extra:
        raise RecordError("invalid_fields", f"unknown record fields {sorted(extra)}")
    for name, typ in _FIELDS.items():
        if name not in obj:
            raise RecordError("invalid_fields", f"record misses {name!r}")
        if not isinstance(obj[name], typ) or isinstance(obj[name], bool):
            raise RecordError(
                "invalid_fields", f"record field {name!r} has type {type(obj[name]).__name__}"
            )
    _check_ids(obj["prompt_ids"], limits.vocab_size, "prompt_ids")
    _check_ids(obj["completion_ids"], limits.vocab_size, "completion_ids")
    n = len(obj["completion_ids"])
    if not 1 <= n <= limits.max_new_tokens:
        raise RecordError(
            "bad_length", f"{n} completion tokens, expected 1..{limits.max_new_tokens}"
        )
    if len(obj["logprobs"]) != n:
        raise RecordError("bad_length", f"{len(obj['logprobs'])} logprobs for {n} tokens")
    _check_logprobs(obj["logprobs"], limits.min_logprob)
    mask = obj.get("loss_mask")
    if mask is not None and (
        not isinstance(mask, list)
        or len(mask) != n
        or any(type(m) is not int or m not in (0, 1) for m in mask)
    ):
        raise RecordError("bad_loss_mask", f"loss_mask must be a list of {n} ints in {{0, 1}}")
    if limits.answer_tokens is not None:
        _check_answers(obj["completion_ids"], mask, limits.answer_tokens)
    if obj.get("versions") is not None:
        check_versions(obj["versions"], n, obj["version"])
    _check_reward(obj["reward"], limits.max_abs_reward)
    stats = None if obj.get("stats") is None else check_stats(obj["stats"])
    if obj.get("cut") is not None and type(obj["cut"]) is not bool:
        raise RecordError(
            "invalid_fields", f"record field 'cut' has type {type(obj['cut']).__name__}"
        )
    gen_s = _as_float(obj["gen_s"], "bad_gen_s")
    if not math.isfinite(gen_s) or gen_s < 0:
        raise RecordError(
            "bad_gen_s", f"gen_s {obj['gen_s']!r} is not a finite number of seconds >= 0"
        )
    if not 0 <= obj["sample_idx"] < limits.group_size:
        raise RecordError(
            "bad_sample_idx", f"sample_idx {obj['sample_idx']} outside [0, {limits.group_size})"
        )
    return Record(
        **{
            **obj,
            "reward": float(obj["reward"]),
            "gen_s": float(obj["gen_s"]),
            "logprobs": [float(x) for x in obj["logprobs"]],
            **(
                {"versions": [list(r) for r in obj["versions"]]}
                if obj.get("versions") is not None
                else {}
            ),
            **({"stats": stats} if stats is not None else {}),
        }
    )
