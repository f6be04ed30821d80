"""The security drill's ``liars`` and ``calibrate`` modes: authenticated workers that lie about
what they deliver, and how fast the learner's checks catch them (docs/security.md).

    python benchmarks/security_drill.py liars [--kinds K ...] [--steps 300] [--runs 3]
    python benchmarks/security_drill.py calibrate [--runs 5] [--steps 300]

``liars``: per kind (benchmarks/drill_workers.py), one quickstart-size run (examples/quickstart.toml,
toy-add, 4 workers of which the last, ``w3``, lies; learner and workers on loopback, CURVE and a
join token), and ``--runs`` all-honest runs for the baseline spread. Per run it records:

  * the learner step at the liar's first delivery: its first acknowledged batch (its ``--ledger``
    file, polled every 0.25 s: at most one step late) or the learner's first check of it
    (``audits.jsonl``), whichever comes first; and the step it was quarantined
    (``<run>/security/quarantine.jsonl``) -> steps to quarantine (target: <= 5);
  * the final reward: mean ``reward_mean`` of the last 20 steps (``metrics.jsonl``; what the
    learner trained on, so claimed rewards count until they are recomputed), and the honest
    workers' own mean adapter reward over the same versions (their truth logs);
  * records rejected by reason (``echo_rejected`` on the learner's /metrics);
  * audits and flags (failed checks) on honest workers (``<run>/security/audits.jsonl``): must be 0;
  * evidence that the liar lied: its truth log (adapter's rewards vs claimed, samples replaced,
    partial groups) against what the learner stored (``buffer.log``, kept whole: no checkpoints).

``calibrate``: ``--runs`` honest runs of ``--steps`` steps, counting audits and flags on honest
workers only. Both write a JSON file under benchmarks/results/ with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, run as a script too
from benchmarks.security_drill import ROOT, Fleet, counters  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402

KINDS = ["forge_rewards", "fake_logprobs", "garbage_tokens", "drop_low", "patient_logprobs"]
WORKERS = 4
LIAR = f"w{WORKERS - 1}"
FINAL_STEPS = 20  # the final reward is the mean over this many last steps
QUARANTINE_TARGET = 5  # steps from the first delivery to quarantine
# The quickstart config, with every worker active (no provisioner holding the liar in standby),
# token joins as a real fleet would use, and no checkpoints: the learner's buffer.log then keeps
# every record it admitted, for comparing with what the workers' adapters scored.
BASE_OVERRIDES = ["provisioning.enabled=false", 'security.join="token"', "learner.checkpoint=false"]

Progress = Callable[[int], None]


def _lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines of ``path`` ([] if absent); a torn last line (file being written) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# ----------------------------------------------------------------------------- one run


def run_fleet(
    tmp: Path,
    kind: str | None,
    steps: int,
    overrides: list[str] | None = None,
    stop_at_quarantine: bool = False,
    progress: Progress | None = None,
    workers: int = WORKERS,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """A learner and ``workers`` drill workers, the last one lying as ``kind`` (None: all honest),
    until the learner has made ``steps`` steps (and exits), or ``timeout_s``; with
    ``stop_at_quarantine``, until the liar is quarantined and has exited."""
    fleet = Fleet(tmp, BASE_OVERRIDES + [f"learner.max_steps={steps}", *(overrides or [])])
    names = [f"w{i}" for i in range(workers)]
    liar = names[-1] if kind else None
    try:
        fleet.start_learner()
        token = fleet.token(workers, "drill")
        for name in names:
            fleet.worker(name, token, kind if name == liar else "honest")
        watch = _watch(fleet, liar, timeout_s or 180 + 3 * steps, stop_at_quarantine, progress)
        watch["exit_codes"] = fleet.stop()
    finally:
        fleet.group.stop_all()
    return _summarize(fleet, kind, liar, names, watch)


def _watch(
    fleet: Fleet,
    liar: str | None,
    timeout_s: float,
    stop_at_quarantine: bool,
    progress: Progress | None,
) -> dict[str, Any]:
    """Poll the run until the learner exits: its step, the liar's first acknowledgement, its
    quarantine and exit, the learner's counters."""
    w: dict[str, Any] = {
        "first_ack_step": None,
        "liar_exit_step": None,
        "counters": {},
        "timed_out": False,
    }
    ledger = fleet.tmp / f"{liar}.ledger"
    step, last_counters, deadline = 0, 0.0, time.monotonic() + timeout_s
    while fleet.alive("learner"):
        if time.monotonic() > deadline:
            w["timed_out"] = True
            break
        try:
            step = fleet.step()
            if time.monotonic() - last_counters > 2.0:
                w["counters"], last_counters = counters(fleet.info["metrics"]), time.monotonic()
        except OSError:
            continue  # the learner is going away: the loop's test says so
        if progress:
            progress(step)
        if liar and w["first_ack_step"] is None and ledger.exists() and ledger.stat().st_size:
            w["first_ack_step"] = step
        if liar and w["liar_exit_step"] is None and not fleet.alive(liar):
            w["liar_exit_step"] = step
        if (
            stop_at_quarantine
            and w["liar_exit_step"] is not None
            and _quarantine_of(fleet.run, liar)
        ):
            break  # quarantined, and its key's ban has reached it
        time.sleep(0.25)  # a polling period: the learner offers no event to wait on
    return w


def _quarantine_of(run: Path, worker: str) -> dict[str, Any] | None:
    return next(
        (q for q in _lines(run / "security/quarantine.jsonl") if q.get("worker_id") == worker), None
    )


def _summarize(
    fleet: Fleet, kind: str | None, liar: str | None, names: list[str], watch: dict[str, Any]
) -> dict[str, Any]:
    rows = _lines(fleet.run / "metrics.jsonl")
    honest = [n for n in names if n != liar]
    last = [r[COL.reward_mean] for r in rows[-FINAL_STEPS:] if r.get(COL.reward_mean) is not None]
    q = _quarantine_of(fleet.run, liar) if liar else None
    first = watch["first_ack_step"]
    audits = _lines(fleet.run / "security/audits.jsonl")
    quarantined = [e.get("worker_id") for e in _lines(fleet.run / "security/quarantine.jsonl")]
    rejected = watch["counters"].get("rejected") or (rows[-1].get("rejected", {}) if rows else {})
    out = {
        "kind": kind or "honest",
        "liar": liar,
        "steps": len(rows),
        "final_reward": round(statistics.fmean(last), 4) if last else None,
        "honest_true_reward": _true_reward(fleet.tmp, honest, len(rows)),
        "rejected": {k: v for k, v in rejected.items() if v},
        "honest_audits": sum(a.get("worker_id") in honest for a in audits),
        "honest_flags": sum(a.get("worker_id") in honest and not a.get("ok", True) for a in audits),
        "honest_quarantined": [w for w in quarantined if w in honest],
        # rows the screen left out of their step (echo_rl/control/screen.py), honest senders' among them
        "honest_screened_groups": sum(
            sum(w in honest for w in e.get("workers", []))
            for e in _lines(fleet.run / "screened.jsonl")
        ),
        "audits_by_check": dict(
            Counter(f"{a.get('check')}:{'ok' if a.get('ok') else 'fail'}" for a in audits)
        ),
        "timed_out": watch["timed_out"],
        "exit_codes": watch["exit_codes"],
    }
    if liar:
        liar_audits = [a for a in audits if a.get("worker_id") == liar]
        first_audit = min((a.get("step", 0) for a in liar_audits), default=None)
        # A liar caught in its first batch never sees an acknowledgement: its first delivery is
        # then the step of the learner's first check of it.
        known = [s for s in (first, first_audit) if s is not None]
        delivered = min(known) if known else None
        out.update(
            {
                "first_ack_step": first,
                "first_liar_audit_step": first_audit,
                "first_delivery_step": delivered,
                "quarantine": q,
                "quarantine_step": q.get("step") if q else None,
                "steps_to_quarantine": q["step"] - delivered
                if q and delivered is not None
                else None,
                "liar_audits": len(liar_audits),
                "liar_flags": sum(not a.get("ok", True) for a in liar_audits),
                "liar_exit_step": watch["liar_exit_step"],
                "liar_said_banned": "banned" in (fleet.tmp / f"{liar}.log").read_text(),
                "lies": lie_evidence(fleet, liar, kind or ""),
            }
        )
    return out


def _true_reward(tmp: Path, honest: list[str], steps: int) -> float | None:
    """The honest workers' mean adapter reward over the samples they generated with the last
    ``FINAL_STEPS`` versions: the policy's quality, whatever the learner was told."""
    rewards = [
        r
        for name in honest
        for batch in _lines(tmp / f"{name}.truth")
        if batch["version"] >= steps - FINAL_STEPS
        for g in batch["groups"]
        for r in g["true"]
    ]
    return round(statistics.fmean(rewards), 4) if rewards else None


def lie_evidence(fleet: Fleet, liar: str, kind: str) -> dict[str, Any]:
    """What the liar scored and claimed (its truth log), and what the learner stored from it."""
    from echo_rl.data.durable import read_log

    groups = [g for batch in _lines(fleet.tmp / f"{liar}.truth") for g in batch["groups"]]
    truth = {g["group_id"]: g for g in groups}
    stored = [r for r in read_log(fleet.run / "buffer.log")[0] if r.worker_id == liar]
    # Distinct samples per group: a partial group goes stale, is granted again and re-admitted.
    per_group: dict[str, set[int]] = {}
    for r in stored:
        per_group.setdefault(r.group_id, set()).add(r.sample_idx)
    ev: dict[str, Any] = {
        "groups_generated": len(groups),
        "samples_generated": sum(g["n"] for g in groups),
        "samples_sent": sum(g["sent"] for g in groups),
        "tokens_replaced": sum(g["tokens_replaced"] for g in groups),
        "logprobs_replaced": sum(g["logprobs_replaced"] for g in groups),
        "stored_records": len(stored),
        "stored_logprob_mean": round(statistics.fmean(x for r in stored for x in r.logprobs), 3)
        if stored
        else None,
        "stored_partial_groups": sum(
            len(ix) < fleet.cfg.learner.group_size for ix in per_group.values()
        ),
    }
    if kind in ("fake_logprobs", "patient_logprobs"):
        # Issue 52: forged groups admitted, screened out of their step (echo_rl/control/screen.py),
        # and trained all the same (consumed by a step without being screened)
        forged = {r.group_id for r in stored if r.logprobs and max(r.logprobs) <= -19.999}
        consumed = {g for e in _lines(fleet.run / "consumed.jsonl") for g in e["groups"]}
        screened = {g for e in _lines(fleet.run / "screened.jsonl") for g in e["groups"]}
        ev["forged_groups_sent"] = sum(g["logprobs_replaced"] > 0 for g in groups)
        ev["forged_groups_admitted"] = len(forged)
        ev["forged_groups_screened"] = len(forged & screened)
        ev["forged_groups_trained"] = len((forged & consumed) - screened)
    if kind not in ("drop_low", "garbage_tokens"):
        # Sample i sent is sample i scored, same tokens: its claimed reward should be the
        # adapter's. (garbage_tokens' claims are the adapter's scores of the garbage: honest.)
        ev["claimed_ne_adapter"] = sum(
            c != t for g in groups for c, t in zip(g["claimed"], g["true"])
        )
        ev["stored_reward_ne_adapter"] = sum(
            r.group_id in truth and r.reward != truth[r.group_id]["true"][r.sample_idx]
            for r in stored
        )
    return ev


# ----------------------------------------------------------------------------- the modes


def _progress_runner() -> tuple[Any, Callable[..., dict[str, Any]]]:
    """A rich Progress and a function running one fleet with a bar for it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )

    def run(
        label: str, kind: str | None, steps: int, overrides: list[str] | None = None
    ) -> dict[str, Any]:
        task = bars.add_task(label, total=steps)
        with tempfile.TemporaryDirectory() as tmp:
            r = run_fleet(
                Path(tmp), kind, steps, overrides, progress=lambda s: bars.update(task, completed=s)
            )
        bars.update(task, completed=r["steps"], description=f"{label} done")
        return r

    return bars, run


def spread(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"n": 0, "mean": None, "min": None, "max": None, "sd": None}
    return {
        "n": len(vals),
        "mean": round(statistics.fmean(vals), 4),
        "min": min(vals),
        "max": max(vals),
        "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else None,
    }


def verdict(r: dict[str, Any], honest: dict[str, Any]) -> dict[str, Any]:
    stq = r.get("steps_to_quarantine")
    lo, hi = honest["min"], honest["max"]
    fr = r["final_reward"]
    return {
        "quarantined": r.get("quarantine_step") is not None,
        "steps_to_quarantine": stq,
        "within_target": stq is not None and stq <= QUARANTINE_TARGET,
        "final_reward": fr,
        "vs_honest_mean": round(fr - honest["mean"], 4)
        if fr is not None and honest["mean"] is not None
        else None,
        "within_honest_range": lo is not None and fr is not None and lo <= fr <= hi,
    }


def liars_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="security_drill.py liars")
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    ap.add_argument("--steps", type=int, default=300, help="learner steps per run")
    ap.add_argument("--runs", type=int, default=3, help="all-honest runs for the baseline spread")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/security_liars.json"))
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every run, e.g. model.name=models/warm-tiny (a "
        "model that has learned something: `echo-rl model export`)",
    )
    args = ap.parse_args(argv)
    from echo_rl.core.machine import write_result

    t0 = time.monotonic()
    bars, run = _progress_runner()
    with bars:
        honest_runs = [
            run(f"honest {i + 1}/{args.runs}", None, args.steps, args.set) for i in range(args.runs)
        ]
        kinds = {k: run(k, k, args.steps, args.set) for k in args.kinds}
    base = spread([r["final_reward"] for r in honest_runs])
    summary = {k: verdict(r, base) for k, r in kinds.items()}
    honest_flags = sum(r["honest_flags"] for r in [*honest_runs, *kinds.values()])
    result = {
        "overrides": BASE_OVERRIDES + args.set,
        "steps": args.steps,
        "workers": WORKERS,
        "wall_s": round(time.monotonic() - t0, 1),
        "honest_final_reward": base,
        "honest_runs": honest_runs,
        "kinds": kinds,
        "summary": summary,
        "honest_flags_total": honest_flags,
        "honest_audits_total": sum(r["honest_audits"] for r in [*honest_runs, *kinds.values()]),
    }
    write_result(args.json, result)
    print_liars(result)
    ok = honest_flags == 0 and all(v["within_target"] for v in summary.values())
    return 0 if ok else 1


def calibrate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="security_drill.py calibrate")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for every run (repeatable)",
    )
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/security_calibrate.json"))
    args = ap.parse_args(argv)
    from echo_rl.core.machine import write_result

    t0 = time.monotonic()
    bars, run = _progress_runner()
    with bars:
        runs = [
            run(f"honest {i + 1}/{args.runs}", None, args.steps, args.set) for i in range(args.runs)
        ]
    result = {
        "overrides": BASE_OVERRIDES + args.set,
        "steps": args.steps,
        "workers": WORKERS,
        "wall_s": round(time.monotonic() - t0, 1),
        "audits": sum(r["honest_audits"] for r in runs),
        "flags": sum(r["honest_flags"] for r in runs),
        "quarantined": sum(len(r["honest_quarantined"]) for r in runs),
        "screened": sum(r["honest_screened_groups"] for r in runs),
        "final_reward": spread([r["final_reward"] for r in runs]),
        "runs": runs,
    }
    write_result(args.json, result)
    from rich.console import Console

    Console().print(
        f"calibrate: {args.runs} honest runs x {args.steps} steps: {result['audits']} audits "
        f"of honest workers, {result['flags']} flagged, {result['quarantined']} quarantined, "
        f"{result['screened']} screened out of a step; "
        f"final reward {result['final_reward']}"
    )
    # A screened honest group is left out of one step and its immediate audit passes: no
    # strike, so it is reported, not failed on (echo_rl/control/screen.py)
    return 0 if result["flags"] == result["quarantined"] == 0 else 1


def print_liars(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = result["honest_final_reward"]
    table = Table(
        title=f"Lying workers ({result['steps']} steps, {result['workers']} workers, 1 lying; "
        f"honest final reward {base['mean']} in [{base['min']}, {base['max']}], n={base['n']})"
    )
    for col in (
        "kind",
        "1st delivery step",
        "quarantined at",
        "steps to q.",
        "final reward",
        "honest truth",
        "rejected by the learner",
        "lies told / stored",
        "honest audits / flags",
    ):
        table.add_column(col, overflow="fold")
    for kind, r in result["kinds"].items():
        ev, v = r["lies"], result["summary"][kind]
        told = (
            f"sent {ev['samples_sent']}/{ev['samples_generated']}, tokens {ev['tokens_replaced']}, "
            f"logp {ev['logprobs_replaced']}, reward≠adapter {ev.get('claimed_ne_adapter', '-')}; "
            f"learner stored {ev['stored_records']} ({ev['stored_partial_groups']} partial groups, "
            f"reward≠adapter {ev.get('stored_reward_ne_adapter', '-')})"
        )
        table.add_row(
            kind,
            str(r["first_delivery_step"]),
            str(r["quarantine_step"] if v["quarantined"] else "no"),
            str(v["steps_to_quarantine"]),
            str(r["final_reward"]),
            str(r["honest_true_reward"]),
            ", ".join(f"{k}={n}" for k, n in r["rejected"].items()) or "-",
            told,
            f"{r['honest_audits']} / {r['honest_flags']}",
        )
    console = Console(width=200)
    console.print(table)
    console.print(
        {
            "honest_runs_audits": [r["honest_audits"] for r in result["honest_runs"]],
            "honest_flags_total": result["honest_flags_total"],
        }
    )
