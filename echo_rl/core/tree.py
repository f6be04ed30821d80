"""The relay tree of the current version: who pulls the snapshot from whom, and how.

Built on the learner's control loop from its broadcast coordinator
(``echo_rl.broadcast.tree.relay_tree``), served as ``tree`` in the dashboard's ``/api/state`` and
exported per worker on ``/metrics`` (``echo_rl.core.tree_metrics``). One schema for both ends:
unknown fields are refused and rates are finite, so a renamed field fails here, not in the
browser.

Where each figure comes from (the dashboard's labels say the same):
  * ``parent``, ``role``, ``transport``: the coordinator's plan, i.e. the learner's own decision;
  * ``nat``: the verdict of the learner's NAT reflector (``echo_rl.broadcast.nat.reflect``), not the
    worker's claim;
  * ``measured_*_mbit``: rates reported by the workers at both ends of each snapshot link,
    combined by the learner (``echo_rl.broadcast.link_meter.LinkMeter``); ``None`` until measured;
  * ``declared_*_mbit``: what the worker declared at join (``--down-mbit``/``--up-mbit``), which
    the planner trusts only until it is measured, capped at the fleet's median.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LEARNER = "learner"  # ``TreeNode.parent`` of a worker fed by the learner itself

# head: fed by the learner; relay: fed by a worker, feeds others; tail: fed by a worker, feeds
# no one; unplaced: in no plan yet (a joiner pulls from any holder until the next publication)
# or kept out of it (its relay was reported unreachable, docs/security.md "Relay reports")
Role = Literal["head", "relay", "tail", "unplaced"]
Transport = Literal["tcp", "punched"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class TreeNode(_Strict):
    worker: str
    parent: str | None  # LEARNER, a worker id, or None when unplaced
    source: str  # the endpoint it pulls from ("" when unplaced)
    role: Role
    children: int = Field(ge=0)
    transport: Transport
    nat: str  # reachable | punchable | none | unknown (not classified yet)
    relay_endpoint: str  # where it serves chunks to its children ("": it relays nothing)
    measured_down_mbit: float | None = Field(None, ge=0)
    measured_up_mbit: float | None = Field(None, ge=0)
    declared_down_mbit: float = Field(0.0, ge=0)
    declared_up_mbit: float = Field(0.0, ge=0)
    installed_s: float | None = Field(None, ge=0)  # after the version's publication


class RelayTree(_Strict):
    version: int | None  # the newest published version (None before the first)
    source: str  # the learner's snapshot endpoint
    nodes: list[TreeNode]  # parents before their children, heads in plan order


def role_of(parent: str | None, children: int) -> Role:
    """A worker's place in a chain, from its parent and how many pull from it."""
    if parent is None:
        return "unplaced"
    if parent == LEARNER:
        return "head"
    return "relay" if children else "tail"
