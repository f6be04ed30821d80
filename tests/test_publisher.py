"""The learner's publisher (echo_rl/learner/publisher.py) on its thread and on the caller's
(``learner.release_thread`` off, a CPU learner's default): the same publications, in order,
and a failure raised on the training thread either way, never swallowed."""

from __future__ import annotations

import threading

import pytest
import torch

from echo_rl.broadcast.snapshot import RunKey, Snapshot
from echo_rl.broadcast.versions import VersionEncoder
from echo_rl.core.models import params_to_payload
from echo_rl.learner.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


def versions(n: int = 4) -> list[tuple[int, list, bytes]]:
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g)}
    out = []
    for v in range(n):
        w["a"][v] += 1.0  # one row a version: deltas
        tensors, payload = params_to_payload(w.items(), "bfloat16")
        out.append((v, tensors, payload))
    return out


def publish_all(threaded: bool, key: RunKey) -> tuple[list[Snapshot], set[str]]:
    seen: list[Snapshot] = []
    threads: set[str] = set()

    def sink(snap: Snapshot) -> None:
        seen.append(snap)
        threads.add(threading.current_thread().name)

    enc = VersionEncoder(run_id="r", key=key, chunk_size=1024, dtype="bfloat16")
    pub = Publisher(enc, sink, threaded=threaded)
    for v, tensors, payload in versions():
        pub.submit(v, tensors, payload)
        if not threaded:  # built before submit returns
            assert pub.published == v + 1 and seen[-1].manifest.version == v
    pub.flush()
    pub.close()
    return seen, threads


def test_inline_and_threaded_publish_the_same_versions_in_order():
    key = RunKey.generate()
    threaded, on_thread = publish_all(True, key)
    inline, on_caller = publish_all(False, key)
    assert on_thread == {"echo-publisher"} and on_caller == {threading.current_thread().name}
    assert [s.manifest.version for s in inline] == [0, 1, 2, 3]
    assert [s.manifest.encoding for s in inline] == ["full", "delta", "delta", "delta"]
    for a, b in zip(threaded, inline):
        assert bytes(a.payload) == bytes(b.payload) and bytes(a.full) == bytes(b.full)


class Broken(VersionEncoder):
    def build(self, version, tensors, full):
        raise ValueError(f"cannot encode v{version}")


@pytest.mark.parametrize("threaded", [True, False])
def test_a_failed_build_is_raised_on_the_training_thread(threaded):
    pub = Publisher(
        Broken(run_id="r", key=RunKey.generate(), chunk_size=1024, dtype="bfloat16"),
        lambda snap: None,
        threaded=threaded,
    )
    v, tensors, payload = versions(1)[0]
    if threaded:
        pub.submit(v, tensors, payload)  # handed over; the thread fails on it
        with pytest.raises(RuntimeError, match="snapshot publisher failed.*cannot encode v0"):
            pub.flush()
    else:
        with pytest.raises(ValueError, match="cannot encode v0"):
            pub.submit(v, tensors, payload)
    pub.close()
