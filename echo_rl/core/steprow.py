"""The metrics step row: one line of ``metrics.jsonl`` per learner step, and the run's
``summary.json``. One declared type each, because these names are the contract between the
learner (which writes them), the report, the dashboard (``/api/state``; its JavaScript reads
the same keys), the benchmarks and the simulator's comparisons. A renamed field then fails
where it is read, not silently as a missing column. Names and meanings: docs/observability.md.

Readers use the attributes, or the column names in ``COL`` (``COL.bubble_ratio ==
"bubble_ratio"``) where a name is needed as a string (pandas columns, Prometheus sources).

JSON: ``to_json`` writes the fields in declaration order, which is the order the learner has
always written them, so ``metrics.jsonl`` stays byte-compatible. ``from_json`` is tolerant of
rows from other versions: a missing field reads as None and is remembered as missing (written
back, it stays absent); an unknown field is kept in ``extra`` and written back after the
declared ones, so a resumed run or a replay loses nothing a newer learner wrote.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace

from echo_rl.core.jsontypes import JsonObject, JsonValue

Counts = dict[str, int]  # {reason or kind: n}; JSON object keys are strings


@dataclass
class StepRow:
    """One learner step. Counters marked "so far" are cumulative over the run."""

    step: int | None = None  # the step's index, from 0
    version: int | None = None  # policy version the batch was trained at (one per step)
    reward_mean: float | None = None  # mean reward of the batch's records
    staleness_max: int | None = None  # versions: trained-at version minus oldest sampler's
    staleness_mean: float | None = None  # versions, mean over the batch's records
    # {staleness in versions: records}; keys are ints as built, strings as read back from JSON
    staleness_counts: dict[int, int] | dict[str, int] | None = None
    tokens_trained: int | None = None  # generated tokens in the batch (docs/preemption.md)
    mixed_version_samples: int | None = None  # records continued across a preemption
    gen_s_mean: float | None = None  # s: mean busy time of the worker batch each record came in
    t_train: float | None = None  # s: the optimizer step
    t_wait: float | None = None  # s: waiting for admissible groups
    # s: the training thread's part of a publication: the checkpoint and handing the snapshot
    # to the publisher, or with learner.release_thread its host copy and any wait for the
    # previous version's release
    t_publish: float | None = None
    bubble_ratio: float | None = None  # sum(t_wait) / sum(t_train + t_wait) so far, after step 0
    admitted: int | None = None  # records admitted to the buffer so far
    duplicates: int | None = None  # resent records already held, so far
    dropped_stale: int | None = None  # records dropped as too stale, so far
    active_workers: int | None = None  # live active workers now
    standby_workers: int | None = None  # live standby workers now
    fleet_price_per_hour: float | None = None  # $/h: sum of the active workers' prices
    worker_rate_mean: float | None = None  # trajectories/s per busy second, as workers report
    worker_busy_rate: float | None = None  # trajectories per busy second, measured, whole run
    cost_step_usd: float | None = None  # $: the fleet's price over t_train + t_wait
    rejected: Counts | None = None  # records/frames refused by reason, so far
    handbacks: JsonObject | None = None  # returned work by kind (docs/preemption.md)
    # an expensive reward's audits off the step, so far (echo_rl.control.reward_audit); None: inline
    reward_audit: dict[str, float] | None = None
    # affinity routing (learner.affinity), so far: prompts routed out of the adapter's order,
    # taken for their age, and prompts with a learned length; None: off
    affinity: dict[str, int] | None = None
    control_cpu: dict[str, float] | None = None  # s of the control loop's CPU by kind, so far
    learner_bytes_sent: int | None = None  # bytes of snapshots the learner served, so far
    t_bcast: float | None = None  # s: broadcast time of the latest measured publication
    reissued_groups: int | None = None  # groups handed out again after a lease expired, so far
    ready_groups: int | None = None  # whole groups waiting in the buffer now
    partial_groups: int | None = None  # groups with some records in the buffer now
    restored_leases: int | None = None  # leases kept across a restart (echo_rl.control.grants)
    restored_admitted: int | None = None  # records admitted under those leases
    relay_reports: Counts | None = None  # relay reports by "reason:outcome" (docs/security.md)
    relays_marked: int | None = None  # relays kept out of plans now
    # The trainer's numbers (echo_rl/learner/trainer.py), rounded to 5 digits; missing when it did
    # not report them (truncated_frac: only with learner.mask_truncated_completions).
    truncated_frac: float | None = None  # share of completions whose loss was masked
    entropy_est: float | None = None  # nats/token: sampled-token entropy estimate
    clip_frac: float | None = None  # share of tokens whose ratio was clipped
    is_weight_mean: float | None = None  # mean importance weight (behaviour -> old policy)
    is_zeroed_frac: float | None = None  # share of tokens whose importance weight was cut to 0
    kl_mean: float | None = None  # nats/token against the reference model
    # nats/token: KL from the policies the workers sampled with to the learner's at the step's
    # start, over the trained tokens (what staleness and snapshot rounding put between them)
    sampling_lag_kl: float | None = None
    grad_norm: float | None = None  # gradient norm before clipping at 1
    loss: float | None = None  # GRPO loss, mean over the step's updates
    skipped_nonfinite: float | None = None  # updates skipped for a non-finite loss or gradient
    wall_s: float | None = None  # s since the run (or its first instance) started
    nonfinite_values: int | None = None  # values above that were NaN/inf, written as null
    # share of completions cut: single-turn, stopped at max_new_tokens without end-of-sequence;
    # multi-turn, episodes that stopped at a limit (the record's ``cut``, as workers report it)
    completions_cut: float | None = None
    publish_refused: int | None = None  # publications refused as non-finite, so far
    # The newest publication (echo_rl/learner/release.py); missing before the first one.
    publish_encoding: str | None = None  # "full" or a delta encoding
    publish_bytes: int | None = None  # bytes of its payload
    publish_full_bytes: int | None = None  # bytes of the version in full
    delta_ratio: float | None = None  # publish_bytes / publish_full_bytes
    delta_changed: float | None = None  # share of parameters the delta changed
    encode_s: float | None = None  # s: building it (encode, hashes, signature)
    # s: the newest version's checkpoint and payload, off the training thread
    # (learner.release_thread); t_publish is what the training thread waited of it
    release_s: float | None = None
    keyframes_published: int | None = None  # keyframes published so far
    decode_s: float | None = None  # s: median time workers took to rebuild the newest delta
    keyframe_installs: int | None = None  # installs that needed a keyframe, so far
    t_audit: float | None = None  # s: audits run after this step
    audits: int | None = None  # audits done so far
    audit_failures: int | None = None  # audits failed so far
    audit_queue: int | None = None  # groups waiting for an audit now
    audits_dropped: int | None = None  # audits dropped (queue full) so far
    audits_expired: int | None = None  # audits given up (too old) so far
    memory: dict[str, int] | None = None  # bytes by use (docs/memory.md)
    # Watching the policy (echo_rl/learner/watch.py, docs/learner.md "Watching the policy"):
    flat_groups: float | None = None  # share of the step's groups whose samples scored alike
    flat_skipped: int | None = None  # such groups left out of training so far (dynamic_sampling)
    # the newest held-out score that came back by this step (learner.heldout): the steps its
    # checkpoint had taken, the mean over prompts and its 95 % interval; best_step: the steps
    # of checkpoints/best.pt, the highest so far
    heldout_step: int | None = None
    heldout_mean: float | None = None
    heldout_lo: float | None = None
    heldout_hi: float | None = None
    best_step: int | None = None
    collapse: str | None = (
        None  # why the policy looks to be collapsing, in words; None: it does not
    )
    # multi-turn: per name, the mean of the episodes' ``info`` numbers (the records' ``stats``)
    # over the step's records that carry it, at most 16 names; as workers report them: shown,
    # never trained on (docs/adapters.md, "Multi-turn adapters"). None: no record carried any
    episode_stats: dict[str, float] | None = None
    # Not fields of the row: what from_json found that this version does not declare, and
    # which declared fields the source lacked (both written back as they were).
    extra: JsonObject = field(default_factory=dict, repr=False, compare=False)
    missing: set[str] = field(default_factory=set, repr=False, compare=False)

    @staticmethod
    def fields() -> tuple[str, ...]:
        """The declared row keys, in the order they are written."""
        return _NAMES

    def to_json(self) -> JsonObject:
        """The row as written: a field left missing is absent unless it was set since."""
        out: JsonObject = {
            n: v for n in _NAMES if (v := getattr(self, n)) is not None or n not in self.missing
        }
        out.update(self.extra)
        return out

    def leave_out(self, names: tuple[str, ...]) -> None:
        """Fields this row does not have (rather than has as null): left out of the JSON
        until set."""
        self.missing.update(names)

    @classmethod
    def from_json(cls, doc: JsonObject) -> StepRow:
        """Tolerant, not a validator: a declared field takes the value as read."""
        row = cls()
        for k, v in doc.items():
            if k in _NAME_SET:
                setattr(row, k, v)
            else:
                row.extra[k] = v
        row.missing = {n for n in _NAMES if n not in doc}
        return row

    def set_reported(self, names: tuple[str, ...], values: Mapping[str, JsonValue]) -> None:
        """Fields some part reports only when it has them (the trainer's numbers, the newest
        publication): those in ``values`` are set, the rest of ``names`` left missing. A value
        under a name this type does not declare goes to ``extra``."""
        self.leave_out(tuple(n for n in names if n not in values))
        for name, value in values.items():
            if name in _NAME_SET:
                setattr(self, name, value)
                self.missing.discard(name)  # written even when null
            else:
                self.extra[name] = value


_NAMES = tuple(f.name for f in fields(StepRow) if f.name not in ("extra", "missing"))
_NAME_SET = frozenset(_NAMES)

# The trainer's numbers and the newest publication's, as the row names them.
TRAINER_FIELDS = (
    "truncated_frac",
    "entropy_est",
    "clip_frac",
    "is_weight_mean",
    "is_zeroed_frac",
    "kl_mean",
    "sampling_lag_kl",
    "grad_norm",
    "loss",
    "skipped_nonfinite",
)
PUBLISH_FIELDS = (
    "publish_encoding",
    "publish_bytes",
    "publish_full_bytes",
    "delta_ratio",
    "delta_changed",
    "encode_s",
    "keyframes_published",
    "release_s",
)

# The row's keys as constants (``COL.t_wait == "t_wait"``): for pandas columns and other
# places that need the name as a string, so no reader spells a key itself.
COL = SimpleNamespace(**{n: n for n in _NAMES})


def read_rows(path: Path) -> list[StepRow]:
    """A run's ``metrics.jsonl`` (none: an empty list)."""
    if not path.exists():
        return []
    return [StepRow.from_json(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]


def as_row(row: StepRow | JsonObject) -> StepRow:
    """A row given either way (a dict: read from a file or written by hand in a test)."""
    return row if isinstance(row, StepRow) else StepRow.from_json(row)


@dataclass
class RunSummary:
    """``summary.json``: the run's outcome in one object."""

    steps: int  # steps run (after a resume: all of them)
    ended: str  # how the run ended: complete, stopped by a signal, stalled
    staleness_budget: int  # learner.staleness
    staleness_max: int | None  # versions: the largest of any step
    reward_first10: float | None  # mean reward of the first 10 steps
    reward_last10: float | None  # mean reward of the last 10 steps
    bubble_ratio: float  # as the last row's, unrounded
    startup_wait_s: float  # s: step 0's wait (workers joining), not in the bubble ratio
    wall_s: float  # s since the run started
    last: JsonObject | None  # the last step row as written
    machine: JsonObject  # echo_rl.core.machine.machine_info()

    def to_json(self) -> JsonObject:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: JsonObject) -> RunSummary:
        """Tolerant like StepRow.from_json: a missing field reads as None; unknown ones are
        dropped (nothing writes summary.json back). Not a validator: a field takes the value
        as read."""
        summary = cls.__new__(cls)
        for f in fields(cls):
            setattr(summary, f.name, doc.get(f.name))
        return summary

    @classmethod
    def read(cls, path: Path) -> RunSummary:
        """A run's ``summary.json``."""
        return cls.from_json(json.loads(path.read_text()))

    @property
    def last_row(self) -> StepRow | None:
        return None if self.last is None else StepRow.from_json(self.last)
