"""The release thread (echo_rl/learner/releasing.py): a version's checkpoint and publication off the
training thread, in order, checkpoint first, on host copies the next step cannot change."""

from __future__ import annotations

import threading

import pytest
import torch

from echo_rl.learner.releasing import HostMirror, ReleaseThread, Version

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def state() -> tuple[dict, dict]:
    model = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)}}, "lr": [1e-3]}
    return model, optim


def test_the_mirror_copies_into_buffers_it_reuses_and_the_source_can_change_after():
    mirror = HostMirror()
    model, optim = state()
    first = mirror.copy((model, optim))
    model["w"].add_(100)  # the next step, in place
    assert torch.equal(first[0]["w"], torch.arange(6.0).view(2, 3))
    assert first[1]["lr"] == [1e-3] and first[1]["state"][0]["step"].item() == 3.0
    buffer = first[0]["w"]
    again = mirror.copy((model, optim))
    assert again[0]["w"] is buffer  # the same buffer, written again
    assert torch.equal(again[0]["w"], model["w"])
    assert mirror.nbytes == sum(t.numel() * 4 for t in (model["w"], model["b"])) + 4 + 24
    model["w"] = torch.zeros(4)  # a tensor that changed shape gets a buffer of its own
    assert mirror.copy((model, optim))[0]["w"].shape == (4,)


class Recorder:
    """The three callbacks, recording their order; ``gate`` holds a checkpoint until set."""

    def __init__(self, finite: bool = True, fail: bool = False) -> None:
        self.events: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.finite_ok, self.fail = finite, fail
        self.saved_w: list[torch.Tensor] = []

    def finite(self, v: Version) -> bool:
        self.events.append(("finite", v.steps))
        return self.finite_ok

    def checkpoint(self, v: Version) -> None:
        self.gate.wait(10)
        if self.fail:
            raise OSError("No space left on device")
        self.saved_w.append(v.model["w"].clone())
        self.events.append(("checkpoint", v.steps))

    def publish(self, v: Version) -> None:
        self.events.append(("publish", v.steps))


def test_versions_are_checkpointed_then_published_in_order_and_the_next_freeze_waits():
    rec = Recorder()
    r = ReleaseThread(rec.finite, rec.checkpoint, rec.publish)
    model, optim = state()
    rec.gate.clear()  # the first checkpoint takes "long"
    r.submit(Version(1, *r.freeze(model, optim), checkpoint=True))
    model["w"].add_(1)  # step 2 trains while version 1 is being released
    froze = threading.Event()

    def second() -> None:
        r.submit(Version(2, *r.freeze(model, optim), checkpoint=True))
        froze.set()

    t = threading.Thread(target=second)
    t.start()
    assert not froze.wait(0.2)  # the freeze waits: version 1 still reads the buffers
    assert r.checkpointed == -1
    rec.gate.set()
    t.join(10)
    r.flush(10)
    assert rec.events == [
        ("finite", 1),
        ("checkpoint", 1),
        ("publish", 1),
        ("finite", 2),
        ("checkpoint", 2),
        ("publish", 2),
    ]
    assert r.checkpointed == 2 and r.released == 2 and r.last_s is not None
    # version 1's checkpoint saw version 1's weights, not step 2's in-place change
    assert torch.equal(rec.saved_w[0], torch.arange(6.0).view(2, 3))
    assert torch.equal(rec.saved_w[1], torch.arange(6.0).view(2, 3) + 1)
    r.close()


def test_a_version_that_is_not_finite_is_neither_checkpointed_nor_published():
    rec = Recorder(finite=False)
    r = ReleaseThread(rec.finite, rec.checkpoint, rec.publish)
    r.submit(Version(1, *r.freeze(*state()), checkpoint=True))
    r.flush(10)
    assert rec.events == [("finite", 1)] and r.checkpointed == -1 and r.released == 0
    r.close()


def test_without_checkpoints_a_version_is_still_published():
    rec = Recorder()
    r = ReleaseThread(rec.finite, rec.checkpoint, rec.publish)
    r.submit(Version(1, *r.freeze(*state()), checkpoint=False))
    r.flush(10)
    assert rec.events == [("finite", 1), ("publish", 1)] and r.checkpointed == -1
    r.close()


def test_a_failure_on_the_thread_is_raised_on_the_training_thread_and_nothing_is_published():
    rec = Recorder(fail=True)
    r = ReleaseThread(rec.finite, rec.checkpoint, rec.publish)
    r.submit(Version(1, *r.freeze(*state()), checkpoint=True))
    with pytest.raises(RuntimeError, match="No space left on device"):
        r.flush(10)
    with pytest.raises(RuntimeError, match="releasing a version failed"):
        r.submit(Version(2, *state(), checkpoint=True))
    assert ("publish", 1) not in rec.events and r.checkpointed == -1
    r.close()


def test_close_finishes_the_version_in_flight():
    rec = Recorder()
    r = ReleaseThread(rec.finite, rec.checkpoint, rec.publish)
    rec.gate.clear()
    r.submit(Version(1, *r.freeze(*state()), checkpoint=True))
    threading.Timer(0.1, rec.gate.set).start()
    r.close(10)
    assert rec.events[-1] == ("publish", 1) and r.checkpointed == 1


def test_a_tensor_under_two_names_is_copied_once_and_stays_shared():
    shared = torch.ones(4)
    out = HostMirror().copy({"embed": shared, "lm_head": shared, "other": torch.zeros(4)})
    assert out["embed"] is out["lm_head"] and out["other"] is not out["embed"]
