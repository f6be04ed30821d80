"""The learner server's parts, built and wired once: each gets the objects it works with as
constructor arguments, complete (nothing is wired after construction); those that message
workers get the control socket's bound methods. Where a part decides something another must
carry out, it returns it: the reputation's quarantine goes back to its caller (the intake's
outcome, the deliveries' verdict), which the deliveries carry out.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.broadcast.store import SnapshotStore
from echo_rl.control.accounts import Accounts
from echo_rl.control.cpu import CpuBook
from echo_rl.control.deliveries import Deliveries, DeliveryChecks, DeliveryLimits
from echo_rl.control.dispatch import Dispatcher, Handler
from echo_rl.control.faults import FaultBook
from echo_rl.control.fleet import FLEET_FILE, FleetBooks, FleetRecord
from echo_rl.control.gate import Gate, security_dir
from echo_rl.control.handbacks import Handbacks
from echo_rl.control.intake import AuditJob, Intake, IntakeChecks
from echo_rl.control.listen import ControlSocket
from echo_rl.control.members import Books, Members
from echo_rl.control.notices import Notices
from echo_rl.control.reputation import Reputation, Verdict
from echo_rl.control.reward_audit import RewardAuditor
from echo_rl.control.routes import RunIdentity, SnapshotRoutes
from echo_rl.control.server_stats import ServerStats, StatSources
from echo_rl.control.sessions import SessionTable
from echo_rl.control.staleness import Staleness
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.durable import BufferLog
from echo_rl.data.records import Limits
from echo_rl.provisioning.controller import Controller, Policy

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.control")


def _step_zero() -> int:
    return 0


@dataclass(frozen=True)
class Inputs:
    """What the learner hands its server: the run, its buffer and queue, and the callbacks."""

    run_id: str
    key: RunKey
    buffer: ReplayBuffer
    work: WorkQueue
    limits: Limits
    buffer_log: BufferLog | None = None
    # key pair, tokens, bans and allow-list live here (None: a throwaway folder, for tests)
    run_dir: Path | None = None
    # recomputes rewards (None: no recomputation, for protocol tests)
    adapter: Adapter | None = None
    audit: Callable[[AuditJob], None] | None = None  # where groups chosen for audit go
    step: Callable[[], int] = _step_zero  # the learner's current step, for the security files


@dataclass(frozen=True)
class Wiring:
    """What the server itself lends its parts: the run folder it settled on, where verdicts
    from other threads go (recorded on its loop, in order) and its answer to a health check."""

    run_dir: Path
    report: Callable[[Verdict], None]
    doctor: Callable[[], wire.Message]


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
        Policy(
            pc.alpha,
            pc.delta,
            pc.window_s,
            warmup_s=pc.warmup_s,
            probation_slots=pc.probation_slots,
            probation_ready_s=pc.probation_ready_s,
            group_size=cfg.learner.group_size,
            probation_group_s=pc.probation_group_s,
        ),
        tau_s=pc.tau_s,
    )


def build_parts(
    cfg: EchoConfig, inp: Inputs, wiring: Wiring, store: SnapshotStore, results: SnapshotStore
) -> Parts:
    sc = cfg.security
    run_dir = wiring.run_dir
    gate = Gate(sc, run_dir)
    table = SessionTable(cfg)
    cpu = CpuBook()  # the loop's CPU per kind of work (echo_rl.control.cpu, docs/scale.md)
    sockets = ControlSocket(table.workers, cpu)  # bound by the server, on its loop
    rejected: Counter[str] = Counter()
    accounts = Accounts()  # what each worker is told about itself (docs/volunteers.md)
    # It records strikes and sentences; whoever hands it a verdict carries out a quarantine.
    reputation = Reputation(security_dir(run_dir), sc.strikes, inp.step)
    audit = inp.audit if sc.audit else None
    # docs/preemption.md: hand-backs checked, counted and bounded (echo_rl.control.handbacks)
    returns = Handbacks(sc, inp.work, audit)
    intake = Intake(
        limits=inp.limits,
        buffer=inp.buffer,
        work=inp.work,
        reputation=reputation,
        buffer_log=inp.buffer_log,
        checks=IntakeChecks(
            adapter=inp.adapter,
            audit=audit,
            audit_rate=sc.audit_rate,
            probation_groups=sc.probation_groups,
            reward_audit=_reward_auditor(cfg, inp.adapter, wiring.report),
            reward_audit_rate=sc.reward_audit_rate,
        ),
        faults=FaultBook(gate.witness, reputation, cfg.adapter.name),
        completions=returns,  # a whole group's reward ranks who had handed it back
    )
    identity = RunIdentity.new(inp.run_id, inp.key)
    routes = SnapshotRoutes(
        cfg,
        gate=gate,
        table=table,
        identity=identity,
        store=store,
        results=results,
        rejected=rejected,
        push=sockets.push,
    )
    members = Members(
        cfg,
        identity=identity,
        table=table,
        gate=gate,
        books=Books(accounts, reputation),
        work=inp.work,
        routes=routes,
        controller=controller(cfg),
    )
    # the provisioner's memory and the accounts, saved across a restart (echo_rl.control.fleet)
    fleet = FleetRecord(FleetBooks(run_dir / FLEET_FILE), members.controller, accounts)
    # docs/security.md, "Staleness is not free": stale deliveries earn less credit
    staleness = Staleness(cfg.learner.staleness, cfg.provisioning.staleness_discount)
    limits = DeliveryLimits(
        inp.limits,
        cfg.learner.staleness,
        bool(getattr(inp.adapter, "multi_turn", False)),
        int(cfg.transport.max_message_mib * 2**20),
    )
    deliveries = Deliveries(
        members=members,
        checks=DeliveryChecks(intake, reputation, returns, staleness),
        buffer=inp.buffer,
        work=inp.work,
        limits=limits,
        rejected=rejected,
        push_ident=sockets.push_ident,
    )
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
        handlers=_handlers(members, routes, deliveries, wiring.doctor),
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


def _reward_auditor(
    cfg: EchoConfig, adapter: Adapter | None, report: Callable[[Verdict], None]
) -> RewardAuditor | None:
    """The thread that recomputes a sample of an expensive reward (echo_rl.control.reward_audit);
    None for an adapter whose reward the learner recomputes inline, or cannot. Its verdicts
    go to ``report``, the server's loop; the server starts it."""
    sc = cfg.security
    if adapter is None or not adapter.expensive_reward or sc.expensive_reward_check == "every":
        return None
    return RewardAuditor(adapter, sc.audit_queue, report)


def _handlers(
    members: Members,
    routes: SnapshotRoutes,
    deliveries: Deliveries,
    doctor: Callable[[], wire.Message],
) -> dict[type[wire.Message], Handler]:
    """Which part answers each request (the doctor's is the server's own)."""

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
        wire.Doctor: lambda ident, key, msg: doctor(),
    }
