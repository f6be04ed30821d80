"""The learner's feedback to the provisioning controller (docs/design.md §4): after every step,
the capacity it needs now (``mu_req`` from a moving average of ``t_train`` and the latest
``T_bcast``), and the controller's decisions since the last step, written to
``decisions.jsonl`` and the dashboard."""

from __future__ import annotations

import logging
from collections.abc import Callable

from echo_rl.control.server import LearnerServer
from echo_rl.core.config import EchoConfig
from echo_rl.core.metrics import LearnerMetrics
from echo_rl.core.security import LogThrottle
from echo_rl.core.steprow import StepRow
from echo_rl.learner.trails import Trails
from echo_rl.provisioning.capacity import Infeasible, mu_req, t_train_average

log = logging.getLogger("echo.learner")


class CapacityFeedback:
    def __init__(
        self,
        cfg: EchoConfig,
        server: LearnerServer,
        trails: Trails,
        metrics: LearnerMetrics | None,
        step: Callable[[], int],
    ):
        self.cfg, self.server, self.trails, self.metrics = cfg, server, trails, metrics
        self._step = step
        self.t_train_ewma: float | None = None
        # The advice is the same step after step (13 a second in the drill wrote it 13 times
        # a second): once a minute per kind of advice.
        self._said = LogThrottle(period_s=60.0)

    def tell(
        self, t_train: float | None, t_bcast: float, rows: list[StepRow], snapshot_path: str = ""
    ) -> None:
        """Tell the controller what capacity the learner needs now, and record the decisions
        it took since the last step. ``t_train`` None: after ``--resume``, from the run's own
        history (``rows``, the restored metrics rows), so a restarted learner knows its mu_req
        before its first step. ``snapshot_path``: what the workers' failed fetches say of the
        learner's snapshot port (the step's control stats, echo_rl/control/snapshot_path.py)."""
        lc = self.cfg.learner
        for t in [r.t_train for r in rows if r.t_train] if t_train is None else [t_train]:
            self.t_train_ewma = t_train_average(self.t_train_ewma, t)
        if self.t_train_ewma is None:
            return
        try:
            need = mu_req(
                lc.prompts_per_step * lc.group_size, lc.effective_kappa, self.t_train_ewma, t_bcast
            )
        except Infeasible as err:
            # A broadcast that never ends is a port the workers cannot reach, not a kappa to
            # raise, when the workers say so (echo_rl/control/snapshot_path.py)
            if self._said.ok("port" if snapshot_path else "kappa"):
                log.warning("%s", snapshot_path or err)
            need = None
        self.server.set_requirement(need)
        while self.server.members.decisions:
            d = self.server.members.decisions.pop(0)
            entry = {
                "action": d.action,
                "worker": d.worker_id,
                "reason": d.reason,
                "c_eff": d.c_eff,
                "target": d.target,
                "mu_req": need,
            }
            self.trails.write("decisions", entry)
            if self.metrics is not None:
                self.metrics.add_decision({"step": self._step(), **entry})
