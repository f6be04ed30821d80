"""The learner's start-up around its ``Learner``: logging, the ports a resumed run listens on,
the start-up objects frozen out of the collector's reach, and the announcement (learner.json,
the dashboard and /metrics, the join line)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.control.listen import port_taken
from echo_rl.control.server import LearnerServer
from echo_rl.core.config import EchoConfig, ListenPorts
from echo_rl.core.metrics import LearnerMetrics, LiveSources
from echo_rl.core.metrics_server import MetricsServer
from echo_rl.core.procs import READY_PREFIX
from echo_rl.core.steprow import StepRow

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.learner")


def setup_logging(run_dir: Path) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(run_dir / "learner.log")
    fh.setFormatter(fmt)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(fmt)
    err.setLevel(logging.WARNING)
    root.addHandler(fh)
    root.addHandler(err)


def _previous_ports(run_dir: Path) -> ListenPorts | None:
    """The ports the run's last learner listened on, from its learner.json (one written
    before the ports were recorded gives its control port only)."""
    info = run_dir / "learner.json"
    if not info.exists():
        return None
    doc = json.loads(info.read_text())
    p = doc.get("ports") or {}
    control = int(doc["endpoint"].rsplit(":", 1)[1])
    return ListenPorts(
        control,
        int(p.get("chunks", 0)),
        tuple(p.get("reflectors", (0, 0))),
        int(p.get("metrics", 0)),
    )


def reuse_ports(cfg: EchoConfig, run_dir: Path) -> None:
    """On resume, listen where the workers knew us: every port the config leaves to the OS
    takes the run's previous one; a port the config fixes stays (docs/ports.md)."""
    previous = _previous_ports(run_dir)
    if previous is None:
        return
    ports = cfg.listen_ports().reusing(previous)
    cfg.learner = cfg.learner.model_copy(
        update={
            "port": ports.control,
            "chunk_port": ports.chunks,
            "reflector_ports": list(ports.reflectors),
        }
    )
    cfg.metrics = cfg.metrics.model_copy(update={"port": ports.metrics})


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (torch, transformers, the model: about 400,000
    here) out of the garbage collector's reach. A full collection walks every tracked object
    while holding the GIL: 160 ms on this machine, which stalled the learner server's loop and
    was the whole tail of the heartbeat round trip (benchmarks/load_control.py, docs/learner.md).
    Those objects live as long as the process, so nothing collectable is frozen for long."""
    import gc

    gc.collect()
    gc.freeze()


def announce(
    cfg: EchoConfig,
    run_dir: Path,
    server: LearnerServer,
    metrics: LearnerMetrics | None,
    rows: list[StepRow],
) -> MetricsServer | None:
    """learner.json (endpoints, join line, ports), the dashboard and /metrics, and the
    join line on stdout (for a supervisor) and on the terminal (for an operator). Returns the
    metrics server (None without metrics), for the learner to close."""
    metrics_server: MetricsServer | None = None
    join = server.join_line()
    info: dict[str, Any] = {
        "endpoint": server.endpoint,
        "snapshot_endpoint": server.snapshot_endpoint,
        "join": join,
        "public_key": (server.public_key or b"").decode(),
        "ports": server.bound_ports(),
    }
    if metrics is not None:
        port = cfg.listen_ports().metrics
        try:
            live = LiveSources(accounts=server.accounts.export, tree=server.relay_tree)
            metrics_server = metrics.serve(cfg.metrics.host, port, live)
        except OSError as exc:
            raise port_taken("metrics.port", cfg.metrics.host, port, exc) from None
        info["ports"]["metrics"] = metrics_server.address[1]
        info["metrics"] = metrics_server.url
        for r in rows:  # after --resume: cost and curves continue
            metrics.update(r, {})
        log.info("dashboard and /metrics at %s", metrics_server.url)
    (run_dir / "learner.json").write_text(json.dumps(info))
    # The join line carries the learner's public key: workers pin it (docs/security.md).
    print(READY_PREFIX + join, flush=True)
    # The line an operator copies, on the terminal (README "Running for real" quotes it).
    words = (
        f"echo-worker join '{join}?token=TOKEN' (a token: echo-rl token create --run-dir {run_dir})"
        if cfg.security.join == "token"
        else f"echo-worker join '{join}'"
    )
    print(f"workers join with: {words}", file=sys.stderr, flush=True)
    log.info("workers join with: %s", words)
    return metrics_server


def say_config(cfg: EchoConfig) -> str:
    """What this run changes from the defaults (issue 56, "one place for defaults"): the
    count and the first keys on the terminal, every key in the log. Returns the line."""
    from echo_rl.core.config_toml import differences, say_differences

    line = say_differences(cfg)
    print(line, file=sys.stderr, flush=True)
    for key, value, default in differences(cfg):
        log.info("config: %s = %r (default %r)", key, value, default)
    return line


def say_length_fit(
    cfg: EchoConfig, adapter: Adapter, tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module
) -> str:
    """A warning, in the log and returned, when the task's sequences outgrow the positions
    the model was built for (issue 56: a 70-token episode on a 64-position model started
    without a word); "" when they fit. Prompts: the first 64 the adapter draws (a private
    RNG: the run's stream is untouched)."""
    import random

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return ""
    prompts = adapter.prompts(random.Random(cfg.seed))
    longest = max((len(next(prompts).prompt_ids) for _ in range(64)), default=0)
    multi = getattr(adapter, "multi_turn", False)
    episode = getattr(adapter, "max_completion_tokens", 0) if multi else 0
    budget = max(cfg.worker.max_new_tokens, episode)
    if longest + budget <= limit:
        return ""
    why = (
        f"adapter {cfg.adapter.name}: a prompt of {longest} tokens plus a completion budget of "
        f"{budget} (max of worker.max_new_tokens = {cfg.worker.max_new_tokens}"
        + (f" and the adapter's max_completion_tokens = {episode}" if episode else "")
        + f") needs {longest + budget} positions, and the model was built for {limit} "
        f"(max_position_embeddings): positions past it are extrapolated, not trained. Raise "
        f"model.max_positions (a tiny model), or lower the budget or the episode's length"
    )
    log.warning("%s", why)
    return why
