"""The learner server's parts, built and wired once: each gets the objects it works with as
constructor arguments; those that message workers get the control socket's bound methods.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.broadcast.store import SnapshotStore
from echo_rl.control.accounts import Accounts
from echo_rl.control.cpu import CpuBook
from echo_rl.control.deliveries import Deliveries, DeliveryLimits
from echo_rl.control.dispatch import Dispatcher
from echo_rl.control.faults import FaultBook
from echo_rl.control.fleet import FLEET_FILE, FleetBooks, FleetRecord
from echo_rl.control.gate import Gate, security_dir
from echo_rl.control.handbacks import Handbacks
from echo_rl.control.intake import AuditJob, Intake
from echo_rl.control.listen import ControlSocket
from echo_rl.control.members import Members, RunIdentity
from echo_rl.control.notices import Notices
from echo_rl.control.reputation import Reputation
from echo_rl.control.reward_audit import RewardAuditor
from echo_rl.control.routes import SnapshotRoutes
from echo_rl.control.server_stats import ServerStats, StatSources
from echo_rl.control.sessions import SessionTable
from echo_rl.control.staleness import Staleness
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.durable import BufferLog
from echo_rl.data.records import Limits
from echo_rl.provisioning.controller import Controller

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.control")


@dataclass
class Inputs:
    """What the learner hands its server: the run, its buffer and queue, and the callbacks."""

    run_dir: Path
    run_id: str
    key: RunKey
    buffer: ReplayBuffer
    work: WorkQueue
    limits: Limits
    buffer_log: BufferLog | None
    adapter: Adapter | None  # recomputes rewards (None: no recomputation, for protocol tests)
    audit: Callable[[AuditJob], None] | None  # where groups chosen for audit go
    step: Callable[[], int]  # the learner's current step, for the security files


@dataclass
class Parts:
    gate: Gate
    table: SessionTable
    identity: RunIdentity
    accounts: Accounts
    reputation: Reputation
    intake: Intake
    returns: Handbacks
    routes: SnapshotRoutes
    members: Members
    fleet: FleetRecord
    deliveries: Deliveries
    notices: Notices
    stats: ServerStats
    dispatcher: Dispatcher
    cpu: CpuBook
    rejected: Counter[str]
    socket: ControlSocket
    work: WorkQueue

    def tidy(self, now: float) -> None:
        """Every half second: bans and tokens re-read, silent sessions ended, the provisioner
        ticked, convicted relays re-probed, books and expired leases brought up to date."""
        m = self.members
        self.gate.reload()
        m.reap(now)
        m.provision()
        self.routes.probes.reprobe()
        self.accounts.tick(
            self.table.workers if m.controller is None else m.controller.active_ids(), now
        )
        expired = self.work.expire()
        if expired:
            log.info("%d group lease(s) expired: handed out again", expired)
        late = self.returns.expire()
        if late:
            log.info(
                "%d handed-back group(s) went out without prefixes whose check was "
                "not back within security.handback_hold_s",
                late,
            )


def controller(cfg: EchoConfig) -> Controller | None:
    """The provisioner (echo_rl.provisioning.controller), when provisioning is on."""
    pc = cfg.provisioning
    if not pc.enabled:
        return None
    return Controller(
        pc.alpha,
        pc.delta,
        pc.window_s,
        tau_s=pc.tau_s,
        warmup_s=pc.warmup_s,
        probation_slots=pc.probation_slots,
        probation_ready_s=pc.probation_ready_s,
        group_size=cfg.learner.group_size,
        probation_group_s=pc.probation_group_s,
    )


def build_parts(
    cfg: EchoConfig, inp: Inputs, store: SnapshotStore, results: SnapshotStore
) -> Parts:
    sc = cfg.security
    gate = Gate(sc, inp.run_dir)
    table = SessionTable(cfg)
    cpu = CpuBook()  # the loop's CPU per kind of work (echo_rl.control.cpu, docs/scale.md)
    sockets = ControlSocket(table.workers, cpu)  # bound by the server, on its loop
    rejected: Counter[str] = Counter()
    accounts = Accounts()  # what each worker is told about itself (docs/volunteers.md)
    # Its quarantine callback is the deliveries' (built below, from the reputation itself).
    reputation = Reputation(security_dir(inp.run_dir), sc.strikes, inp.step, _unwired)
    audit = inp.audit if sc.audit else None
    intake = Intake(
        reward_audit=_reward_auditor(cfg, inp.adapter),
        reward_audit_rate=sc.reward_audit_rate,
        limits=inp.limits,
        buffer=inp.buffer,
        work=inp.work,
        reputation=reputation,
        buffer_log=inp.buffer_log,
        adapter=inp.adapter,
        audit=audit,
        audit_rate=sc.audit_rate,
        probation_groups=sc.probation_groups,
        faults=FaultBook(gate.witness, reputation, cfg.adapter.name),
    )
    # docs/preemption.md: hand-backs checked, counted and bounded (echo_rl.control.handbacks)
    returns = Handbacks(sc, inp.work, audit)
    intake.on_complete = returns.completed
    routes = SnapshotRoutes(
        cfg,
        gate=gate,
        table=table,
        key=inp.key,
        run_id=inp.run_id,
        store=store,
        results=results,
        rejected=rejected,
        push=sockets.push,
    )
    identity = RunIdentity.new(inp.run_id, inp.key)
    members = Members(
        cfg,
        identity=identity,
        table=table,
        gate=gate,
        accounts=accounts,
        reputation=reputation,
        work=inp.work,
        routes=routes,
        controller=controller(cfg),
    )
    # the provisioner's memory and the accounts, saved across a restart (echo_rl.control.fleet)
    fleet = FleetRecord(FleetBooks(inp.run_dir / FLEET_FILE), members.controller, accounts)
    # docs/security.md, "Staleness is not free": stale deliveries earn less credit
    staleness = Staleness(cfg.learner.staleness, cfg.provisioning.staleness_discount)
    limits = DeliveryLimits(
        inp.limits,
        cfg.learner.staleness,
        bool(getattr(inp.adapter, "multi_turn", False)),
        int(cfg.transport.max_message_mib * 2**20),
    )
    deliveries = Deliveries(
        table=table,
        members=members,
        gate=gate,
        accounts=accounts,
        intake=intake,
        reputation=reputation,
        returns=returns,
        staleness=staleness,
        buffer=inp.buffer,
        work=inp.work,
        limits=limits,
        rejected=rejected,
        push_ident=sockets.push_ident,
    )
    reputation.on_quarantine = deliveries.quarantine
    notices = Notices(cfg, table=table, members=members, routes=routes, cpu=cpu, send=sockets.send)
    stats = ServerStats(
        StatSources(
            table=table,
            members=members,
            routes=routes,
            gate=gate,
            buffer=inp.buffer,
            work=inp.work,
            intake=intake,
            returns=returns,
            reputation=reputation,
            staleness=staleness,
            accounts=accounts,
            cpu=cpu,
            rejected=rejected,
            noticed=notices.noticed,
        )
    )
    dispatcher = Dispatcher(
        gate=gate,
        handlers=_handlers(members, routes, deliveries),
        max_bytes=limits.max_bytes,
        rejected=rejected,
        end_session=members.end_session,
    )
    return Parts(
        gate=gate,
        table=table,
        identity=identity,
        accounts=accounts,
        reputation=reputation,
        intake=intake,
        returns=returns,
        routes=routes,
        members=members,
        fleet=fleet,
        deliveries=deliveries,
        notices=notices,
        stats=stats,
        dispatcher=dispatcher,
        cpu=cpu,
        rejected=rejected,
        socket=sockets,
        work=inp.work,
    )


def _reward_auditor(cfg: EchoConfig, adapter: Adapter | None) -> RewardAuditor | None:
    """The thread that recomputes a sample of an expensive reward (echo_rl.control.reward_audit);
    None for an adapter whose reward the learner recomputes inline, or cannot. Its verdicts
    go to the server's loop: the server wires ``report`` and starts it."""
    sc = cfg.security
    if adapter is None or not adapter.expensive_reward or sc.expensive_reward_check == "every":
        return None
    return RewardAuditor(adapter, sc.audit_queue, _unwired_report)


def _unwired_report(verdict: Any) -> None:
    raise RuntimeError("a reward verdict before the server wired the auditor")


def _unwired(worker_id: str, key: str, reason: str) -> None:
    raise RuntimeError("quarantine before the server's parts were wired")


def _handlers(
    members: Members, routes: SnapshotRoutes, deliveries: Deliveries
) -> dict[type[wire.Message], Callable[..., Any]]:
    """Which part answers each request (the doctor's is the server's own, added by it)."""

    def on_installed(ident: bytes, key: str, msg: wire.Installed) -> None:
        # a pending key that installed a snapshot has done its first useful act
        members.promote(
            members.table.joined(ident, key, msg.worker_id), f"installed v{msg.version}"
        )
        return routes.on_installed(ident, key, msg)

    return {
        wire.Join: members.on_join,
        wire.Heartbeat: members.on_heartbeat,
        wire.WorkRequest: deliveries.on_work_request,
        wire.Trajectories: deliveries.on_trajectories,
        wire.Leave: members.on_leave,
        wire.SourceRequest: routes.on_source_request,
        wire.Installed: on_installed,
        wire.NatReport: members.on_nat_report,
        wire.Handback: deliveries.on_handback,
    }
