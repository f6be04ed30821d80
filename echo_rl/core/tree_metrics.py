"""``/metrics`` for the relay tree (``echo_rl.core.tree``): each worker's place, NAT verdict, transport and
link rates. Owned by ``echo_rl.core.metrics.LearnerMetrics`` (one registry).

Cardinality is bounded by the coordinator's peers, i.e. the sessions the learner holds now (at
most ``security.max_workers``): one series per worker in each family (two for the rates, by direction), with the state-like labels
(``role``/``parent``, ``nat``, ``transport``) holding one value each at a time. A worker that
leaves the plan's peers loses all its series at the next update, and a changed label value
replaces the old series rather than adding one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from echo_rl.core.tree import RelayTree, TreeNode


class TreeGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        def g(name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.place = g(
            "echo_worker_relay_role",
            "1 for the worker's place in the current "
            "version's relay tree: role (head, relay, tail, unplaced) and parent "
            "(learner or a worker id)",
            ("worker", "role", "parent"),
        )
        self.nat = g(
            "echo_worker_nat",
            "1 for the NAT class the learner's reflector gave the "
            "worker (reachable, punchable, none, unknown)",
            ("worker", "nat"),
        )
        self.transport = g(
            "echo_worker_transport",
            "1 for how the worker's snapshot link is carried now (tcp, punched)",
            ("worker", "transport"),
        )
        self.measured = g(
            "echo_worker_link_mbit",
            "link rate measured on snapshot transfers "
            "(both ends' reports combined by the learner), Mbit/s",
            ("worker", "direction"),
        )
        self.declared = g(
            "echo_worker_declared_mbit",
            "link rate the worker declared at join (not trusted once measured), Mbit/s",
            ("worker", "direction"),
        )
        self._held: dict[str, set[tuple[Gauge, tuple[str, ...]]]] = {}  # worker -> its series

    def update(self, tree: RelayTree) -> None:
        """Set every worker's series from ``tree``; remove those of workers no longer in it and
        label values no longer true."""
        now: dict[str, dict[tuple[Gauge, tuple[str, ...]], float]] = {
            n.worker: self._series(n) for n in tree.nodes
        }
        for worker in set(self._held) | set(now):
            want = now.get(worker, {})
            for gauge, labels in self._held.get(worker, set()) - set(want):
                gauge.remove(*labels)
            for (gauge, labels), value in want.items():
                gauge.labels(*labels).set(value)
            self._held[worker] = set(want)
            if not want:
                del self._held[worker]

    def _series(self, n: TreeNode) -> dict[tuple[Gauge, tuple[str, ...]], float]:
        w = n.worker
        out = {
            (self.place, (w, n.role, n.parent or "")): 1.0,
            (self.nat, (w, n.nat)): 1.0,
            (self.transport, (w, n.transport)): 1.0,
            (self.declared, (w, "down")): n.declared_down_mbit,
            (self.declared, (w, "up")): n.declared_up_mbit,
        }
        for direction, rate in (("down", n.measured_down_mbit), ("up", n.measured_up_mbit)):
            if rate is not None:  # unmeasured: no sample, rather than a 0 that reads as a rate
                out[(self.measured, (w, direction))] = rate
        return out
