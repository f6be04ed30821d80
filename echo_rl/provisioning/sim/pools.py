"""Random heterogeneous fleets for the simulator's ``pool.random`` (and the provisioning
benchmark, ``labs/provisioning_bench.py``).

Pools mimic a rented/volunteer fleet: a per-pool mix of GPU classes (Dirichlet weights, so some
pools are dominated by one class), per-worker throughput lognormal around the class figure
(host CPU, network, model fit), price around the class list price, mildly correlated with the
worker's own throughput and with marketplace noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GpuClass:
    name: str
    mu: float  # trajectories/s for the reference task
    price: float  # $/h, typical marketplace price


# Relative speeds from public inference benchmarks, prices from GPU marketplaces (rounded); only
# the spread matters here: classes differ in both speed and $/trajectory.
GPU_CLASSES = (
    GpuClass("rtx3090", 0.50, 0.22),
    GpuClass("rtx4090", 0.85, 0.35),
    GpuClass("rtx5090", 1.15, 0.35),
    GpuClass("a10", 0.45, 0.50),
    GpuClass("l4", 0.35, 0.45),
    GpuClass("l40s", 1.00, 0.90),
    GpuClass("a100", 1.30, 1.20),
    GpuClass("h100", 2.00, 2.20),
    GpuClass("cpu", 0.03, 0.04),
)


def random_pool(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(mu, price) of ``n`` heterogeneous workers."""
    weights = rng.dirichlet(np.full(len(GPU_CLASSES), 0.7))
    cls = rng.choice(len(GPU_CLASSES), size=n, p=weights)
    base_mu = np.array([c.mu for c in GPU_CLASSES])[cls]
    base_price = np.array([c.price for c in GPU_CLASSES])[cls]
    speed = rng.lognormal(0.0, 0.35, n)  # this host vs the class figure
    mu = base_mu * speed
    price = base_price * speed**0.3 * rng.lognormal(0.0, 0.2, n)
    return mu, price
