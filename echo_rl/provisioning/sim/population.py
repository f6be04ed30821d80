"""The candidate workers a simulator scenario describes (``Pool``, drawn or read by
``build_pool``: ``[pool]`` classes, ``pool.random``, ``pool.file``) and its churn trace
(``read_trace``: ``churn.trace``). The scenario's sections and their validation are
``echo_rl/provisioning/sim/scenario.py``; this reads what they point at.

Relative paths (``pool.file``, ``churn.trace``) are relative to the scenario's TOML file.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np

from echo_rl.provisioning.sim.scenario import Scenario, ScenarioError


@dataclass
class Pool:
    """Every candidate worker, as arrays indexed by worker number."""

    ids: list[str]
    mu: np.ndarray  # trajectories/s
    price: np.ndarray  # $/h
    down: np.ndarray  # Mbit/s
    up: np.ndarray
    reachable: np.ndarray  # bool
    cls: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def _resolve(base_dir: str, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else Path(base_dir or ".") / p


def build_pool(sc: Scenario, rng: np.random.Generator) -> Pool:
    """Draw (or read) the candidate workers. Deterministic for a given ``run.seed``."""
    ps = sc.pool
    mu, price, down, up, reach, cls, ids = [], [], [], [], [], [], []

    def spread(n: int, sigma: float) -> np.ndarray | float:
        return rng.lognormal(0.0, sigma, n) if sigma else 1.0

    def links(n: int, d: float | None, u: float | None, r: float | None) -> None:
        up_sigma = ps.link_sigma if ps.up_sigma is None else ps.up_sigma
        down.append(np.full(n, d or ps.down_mbit) * spread(n, ps.link_sigma))
        up.append(np.full(n, u or ps.up_mbit) * spread(n, up_sigma))
        frac = ps.reachable if r is None else r
        reach.append(rng.random(n) < frac if frac < 1 else np.ones(n, bool))

    for c in ps.classes:
        m = np.full(c.count, c.mu)
        if c.mu_sigma:
            m = m * rng.lognormal(0.0, c.mu_sigma, c.count)
        if c.prices is not None:
            p = np.asarray(c.prices, float)
        else:
            p = np.full(c.count, c.price)
            if c.price_sigma:
                p = p * rng.lognormal(0.0, c.price_sigma, c.count)
        mu.append(m)
        price.append(p)
        links(c.count, c.down_mbit, c.up_mbit, c.reachable)
        cls += [c.name] * c.count
    if ps.random_workers:
        from echo_rl.provisioning.sim.pools import random_pool

        m, p = random_pool(rng, ps.random_workers)
        mu.append(m * ps.mu_scale)
        price.append(p)
        links(ps.random_workers, None, None, None)
        cls += ["bench-mix"] * ps.random_workers
    if ps.file:
        rows = _read_pool_csv(_resolve(sc.base_dir, ps.file))
        mu.append(np.array([r["mu"] for r in rows]))
        price.append(np.array([r["price"] for r in rows]))
        down.append(np.array([r.get("down_mbit") or ps.down_mbit for r in rows]))
        up.append(np.array([r.get("up_mbit") or ps.up_mbit for r in rows]))
        reach.append(np.array([bool(r.get("reachable", True)) for r in rows]))
        cls += ["file"] * len(rows)
        ids_from_file = [r.get("id") for r in rows]
    else:
        ids_from_file = []
    n = len(cls)
    ids = [f"w{i}" for i in range(n - len(ids_from_file))]
    ids += [x or f"w{len(ids) + j}" for j, x in enumerate(ids_from_file)]
    if len(set(ids)) != n:
        raise ScenarioError(
            f"pool.file {ps.file!r}: worker ids must be unique (ids w0..w{n - 1} "
            f"are taken by the generated workers)"
        )
    return Pool(
        ids=ids,
        mu=np.concatenate(mu),
        price=np.concatenate(price),
        down=np.concatenate(down),
        up=np.concatenate(up),
        reachable=np.concatenate(reach).astype(bool),
        cls=cls,
    )


class PoolRow(TypedDict):
    """One worker of a ``pool.file`` CSV; the optional columns only where given."""

    mu: float
    price: float
    down_mbit: NotRequired[float]
    up_mbit: NotRequired[float]
    reachable: NotRequired[bool]
    id: NotRequired[str]


def _read_pool_csv(path: Path) -> list[PoolRow]:
    if not path.is_file():
        raise ScenarioError(
            f"pool.file {str(path)!r} not found: give a CSV with columns "
            f"mu,price[,down_mbit,up_mbit,reachable,id]"
        )
    rows: list[PoolRow] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"mu", "price"} - set(reader.fieldnames or [])
        if missing:
            raise ScenarioError(
                f"pool.file {str(path)!r} lacks column(s) {sorted(missing)}: "
                f"the header must name at least mu,price"
            )
        for line, r in enumerate(reader, start=2):
            try:
                row: PoolRow = {"mu": float(r["mu"]), "price": float(r["price"])}
                if r.get("down_mbit"):
                    row["down_mbit"] = float(r["down_mbit"])
                if r.get("up_mbit"):
                    row["up_mbit"] = float(r["up_mbit"])
                if r.get("reachable"):
                    row["reachable"] = r["reachable"].strip().lower() in ("1", "true", "yes")
                if r.get("id"):
                    row["id"] = r["id"].strip()
            except ValueError as exc:
                raise ScenarioError(
                    f"pool.file {str(path)!r} line {line}: {exc}; numbers "
                    f"expected in mu, price, down_mbit, up_mbit"
                ) from None
            if row["mu"] <= 0 or row["price"] < 0:
                raise ScenarioError(
                    f"pool.file {str(path)!r} line {line}: mu must be > 0 and "
                    f"price >= 0, got mu={row['mu']}, price={row['price']}"
                )
            rows.append(row)
    if not rows:
        raise ScenarioError(f"pool.file {str(path)!r} has no workers")
    return rows


def read_trace(sc: Scenario, pool: Pool) -> list[tuple[float, int, str]]:
    """``(time_s, worker index, "leave"|"join")`` sorted by time."""
    path = _resolve(sc.base_dir, sc.churn.trace)
    if not path.is_file():
        raise ScenarioError(
            f"churn.trace {str(path)!r} not found: give a CSV with columns time_s,worker,event"
        )
    index = {wid: i for i, wid in enumerate(pool.ids)}
    out = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not {"time_s", "worker", "event"} <= set(reader.fieldnames or []):
            raise ScenarioError(
                f"churn.trace {str(path)!r}: the header must be time_s,worker,event"
            )
        for line, r in enumerate(reader, start=2):
            w = r["worker"].strip()
            i = index.get(w)
            if i is None and w.isdigit() and int(w) < len(pool):
                i = int(w)
            if i is None:
                raise ScenarioError(
                    f"churn.trace line {line}: unknown worker {w!r}; use a pool "
                    f"index 0..{len(pool) - 1} or an id such as {pool.ids[0]!r}"
                )
            ev = r["event"].strip().lower()
            if ev not in ("leave", "join"):
                raise ScenarioError(f"churn.trace line {line}: event {ev!r} must be leave or join")
            try:
                t = float(r["time_s"])
            except ValueError:
                raise ScenarioError(
                    f"churn.trace line {line}: time_s {r['time_s']!r} is not a number of seconds"
                ) from None
            if not (t >= 0 and math.isfinite(t)):
                raise ScenarioError(f"churn.trace line {line}: time_s must be >= 0, got {t}")
            out.append((t, i, ev))
    out.sort(key=lambda e: e[0])
    return out
