"""The work plane: grants of prompt groups, trajectory deliveries and their acknowledgements,
hand-backs of leases (control socket)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from echo_rl.core.wire.base import Message


class Prefix(BaseModel):
    """A sample cut short by preemption (docs/preemption.md): the tokens generated so far,
    their behaviour log-probs, and the snapshot version of each as runs ``[version, count]``,
    oldest first. Sent by the preempted worker (``handback``); handed by the learner to the
    worker that continues the sample (``Group.prefixes``), which must deliver a record whose
    completion starts with exactly these tokens and log-probs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    sample_idx: int = Field(ge=0, le=4096)
    ids: list[int] = Field(min_length=1, max_length=65536)
    logprobs: list[float] = Field(min_length=1, max_length=65536)
    # [version, count] pairs (lists: msgpack has no tuples)
    versions: list[Annotated[list[int], Field(min_length=2, max_length=2)]] = Field(
        min_length=1, max_length=64
    )
    # Multi-turn: the prefix is the policy's decisions so far, in order, and these are their
    # lengths; the continuing worker replays them in the episode's environment (empty: one
    # stretch of tokens of a single-turn sample).
    turns: list[int] = Field(default_factory=list, max_length=4096)


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    group_id: str
    prompt_ids: list[int]
    n: int = Field(ge=1)
    seed: int
    task: dict[str, Any] = Field(default_factory=dict)  # what the reward needs (e.g. answer)
    # A continuation (docs/preemption.md): these samples go on from their prefix, the others
    # are generated from the prompt; every sample of the group is delivered, as always.
    prefixes: list[Prefix] = Field(default_factory=list, max_length=4096)
    # The task's own token budget (echo_rl.data.adapter.Prompt.max_new_tokens); None: the run's
    # worker.max_new_tokens. A worker generates at most the smaller of the two.
    max_new_tokens: int | None = Field(default=None, ge=1, le=65536)


class WorkRequest(Message):
    TYPE = "work_request"
    worker_id: str
    max_groups: int = Field(ge=1, le=1024)
    # Groups this worker generated whose batch is not acknowledged yet. A worker asks for work
    # only when it generates nothing, so every other open lease of its own is a grant that was
    # lost on the way: the learner hands those out again at once instead of waiting for the
    # lease to expire. (Absent, from an older worker: every open lease is re-granted and the
    # duplicates are deduplicated at admission.)
    holding: list[str] = Field(default_factory=list, max_length=4096)


class WorkGrant(Message):
    TYPE = "work_grant"
    groups: list[Group]
    retry_after_s: float = 0.0  # set when no work could be handed out


class Trajectories(Message):
    TYPE = "trajectories"
    worker_id: str
    batch_id: str
    count: int = Field(ge=0)
    payload: bytes


# What a volunteer is told, in words, about records refused for reasons that are no fault of
# theirs (the worker's log adds it to the counts an ``ack`` carries).
REFUSAL_WORDS = {
    "learner_restarted": "the learner restarted and did not keep the lease these groups were "
    "generated under; this work is not counted, nothing to fix: new work "
    "follows",
    "stale": "generated under a snapshot older than the staleness bound allows; the group is "
    "generated again under a newer one",
    "not_your_group": "the lease moved to another worker (it expired first); deliver sooner or "
    "ask for fewer groups",
}


class Ack(Message):
    TYPE = "ack"
    batch_id: str
    accepted: int
    duplicates: int
    rejected: dict[str, int] = Field(default_factory=dict)
    rejected_idx: list[int] = Field(default_factory=list)  # positions in the batch not stored


class Handback(Message):
    """A worker gives its leases back before it stops generating (preempted, or yielding
    the machine to its owner): ``groups`` it will not deliver, with ``prefixes`` of the
    samples it had started, per group id. Answered by ``handback_ack``."""

    TYPE = "handback"
    worker_id: str
    reason: Literal["preempted", "yielded"]
    groups: list[str] = Field(max_length=4096)
    prefixes: dict[str, list[Prefix]] = Field(default_factory=dict, max_length=4096)


class HandbackAck(Message):
    TYPE = "handback_ack"
    groups: int = Field(ge=0)  # leases taken back
    prefixes: int = Field(ge=0)  # prefixes kept for a continuation
    refused: dict[str, int] = Field(default_factory=dict)  # prefixes not kept, by reason
