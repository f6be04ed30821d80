"""The coordinator's current plan as an ``echo_rl.core.tree.RelayTree`` (for the dashboard and
``/metrics``). Pure: it reads the coordinator and changes nothing; call it where the coordinator
lives (the learner's control loop). O(peers)."""

from __future__ import annotations

import math

from echo_rl.broadcast.coordinator import Coordinator, PeerState
from echo_rl.core.tree import LEARNER, RelayTree, TreeNode, role_of


def relay_tree(co: Coordinator) -> RelayTree:
    parents = _parents(co)
    children: dict[str, list[str]] = {}
    for worker, parent in parents.items():
        if parent is not None:
            children.setdefault(parent, []).append(worker)
    version = max(co.published, default=None)
    nodes = {
        w: _node(co, p, parents[w], len(children.get(w, ())), version) for w, p in co.peers.items()
    }
    order = _depth_first(children, LEARNER)
    order += [w for w in nodes if w not in set(order)]  # unplaced, or cut off from the root
    return RelayTree(version=version, source=co.source, nodes=[nodes[w] for w in order])


def _parents(co: Coordinator) -> dict[str, str | None]:
    """Each peer's parent in the current plan: LEARNER, a worker id, or None (not in the plan,
    or its planned source is no live relay)."""
    out: dict[str, str | None] = {}
    for worker in co.peers:
        src = co.sources.get(worker)
        if src is None:
            out[worker] = None
        elif src == co.source:
            out[worker] = LEARNER
        else:
            owner = co.owner(src)
            out[worker] = owner.worker_id if owner is not None else None
    return out


def _node(
    co: Coordinator, p: PeerState, parent: str | None, children: int, version: int | None
) -> TreeNode:
    w = p.worker_id
    return TreeNode(
        worker=w,
        parent=parent,
        source=co.sources.get(w, "") if parent else "",
        role=role_of(parent, children),
        children=children,
        transport="punched" if parent and co.transport(w) == "punched" else "tcp",
        nat=p.nat,
        relay_endpoint=p.endpoint,
        measured_down_mbit=_rate(co.links.down.get(w)),
        measured_up_mbit=_rate(co.links.up.get(w)),
        declared_down_mbit=_rate(p.down_mbit) or 0.0,
        declared_up_mbit=_rate(p.up_mbit) or 0.0,
        installed_s=_rate(p.installed.get(version)) if version is not None else None,
    )


def _rate(v: float | None) -> float | None:
    """A rate the schema takes (finite, >= 0), rounded; else None."""
    return round(float(v), 3) if v is not None and math.isfinite(v) and v >= 0 else None


def _depth_first(children: dict[str, list[str]], root: str) -> list[str]:
    out: list[str] = []
    stack = list(reversed(children.get(root, [])))
    seen = {root}
    while stack:
        w = stack.pop()
        if w in seen:  # a cycle would be a planner bug: shown once, not looped on
            continue
        seen.add(w)
        out.append(w)
        stack.extend(reversed(children.get(w, [])))
    return out
