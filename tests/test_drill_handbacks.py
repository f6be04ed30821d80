"""The security drill's cherry-picker (benchmarks/drill_handbacks.py) replaces
``Generation.rollout``: it must keep that method's books itself, or the learner takes the groups
it is generating for lost grants and leases them to it again (each generated twice, the second
hand-back and delivery refused ``not_your_group``, the drill's picker 'handed nothing back')."""

import asyncio
import time
from types import SimpleNamespace

from worker_doubles import make_generation

from benchmarks import drill_handbacks
from echo_rl.core import wire
from echo_rl.worker.backends import Sample


class Clock:
    t = 100.0

    def monotonic(self) -> float:
        return self.t


class Backend:
    """Four finished samples per group; generating one grant takes 2 s of the fake clock. It
    records what a work request sent meanwhile would list as held."""

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    tokens_sampled = 0
    base_hash = None  # echo_rl.worker.backends.base.Backend's: no LoRA base held

    def __init__(self, worker, clock):
        self.worker, self.clock, self.held_meanwhile = worker, clock, []

    def generate(self, groups, max_new_tokens, temperature, stop=None):
        self.held_meanwhile.append(list(self.worker.generating))
        self.clock.t += 2.0
        return [[Sample([5, 2], [-0.5, -0.5]) for _ in range(g.n)] for g in groups]


class Adapter:
    def reward(self, task, ids, text):
        return task["r"]


class Client:
    def __init__(self):
        self.sent = []

    async def request(self, msg, timeout):
        self.sent.append(msg)
        return wire.HandbackAck(groups=len(msg.groups), prefixes=0)


def _drill(kind, clock, monkeypatch, client):
    """The drill's generation part alone, its clock the test's."""
    from echo_rl.worker import generation

    fake_time = SimpleNamespace(monotonic=clock.monotonic, time=time.time)
    monkeypatch.setattr(drill_handbacks, "time", fake_time)
    monkeypatch.setattr(generation, "time", fake_time)
    g = make_generation(client, None, Adapter(), cls=drill_handbacks._generation(kind))
    g.held.backend = Backend(g, clock)
    return g


def test_the_picker_lists_its_groups_as_held_and_times_the_real_generation(monkeypatch):
    clock = Clock()
    w = _drill("cherry_pick", clock, monkeypatch, Client())
    w.seen = [0.5] * 9  # median 0.5: the 0.0 group goes back
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=[1, 2], n=4, seed=i, task={"r": r})
        for i, r in enumerate((1.0, 0.0, 0.9))
    ]

    assert asyncio.run(w.rollout(groups)) is True

    assert w.held.backend.held_meanwhile == [
        ["g0", "g1", "g2"]
    ]  # not []: no lost grant to re-lease
    assert [m.groups for m in w.session.client.sent] == [["g1"]]
    assert [w.deliveries.groups_of[b] for b in w.deliveries.unacked] == [["g0", "g2"]]
    assert w.generating == []
    # the grant's real generation (2 s for 3 groups)
    assert (w.rollout_s, round(w.group_s, 3)) == (2.0, 0.667)


class Feed:
    """The snapshot feed: version 4 is rebuilt and ready to install."""

    def __init__(self):
        self.ready, self.offered = [(4, {"tensors": {}}, None)], []

    def offer(self, version, manifest, source):
        self.offered.append(version)

    def take_ready(self):
        return self.ready.pop() if self.ready else None


class Ticking(Clock):
    def monotonic(self) -> float:  # a second per look: a wait that never ends runs out
        self.t += 1.0
        return self.t


def test_the_edge_holder_delivers_when_the_learner_is_at_the_edge_and_installs_meanwhile(
    monkeypatch,
):
    clock = Ticking()
    w = _drill("edge_holder", clock, monkeypatch, Client())
    feed = Feed()
    w.installer.ensure_installed = lambda: _install(w, feed)
    g = wire.Group(group_id="g0", prompt_ids=[1, 2], n=4, seed=0, task={"r": 1.0})
    start = clock.t

    async def learner_publishes():
        for v in (4, 5):  # S = 2: version 5 is the edge for a batch generated under 3
            await asyncio.sleep(0.05)
            assert not w.deliveries.unacked  # held until then
            w.newest = v  # what the worker's offer hook records

    async def both():
        return (await asyncio.gather(w.rollout([g]), learner_publishes()))[0]

    assert asyncio.run(both()) is True

    assert clock.t - start < 60  # not the 60 s give-up
    assert w.held.version == 4 and w.newest == 5
    batch = next(iter(w.deliveries.unacked.values()))
    assert {r["version"] for r in wire.unpack_records(batch.payload, 1 << 20)} == {
        3
    }  # generated under 3
    assert w.held.backend.held_meanwhile == [["g0"]] and w.generating == []


async def _install(w, feed):
    """The installer's step: the feed's ready version into the model."""
    ready = feed.take_ready()
    if ready is not None:
        w.held.version = ready[0]
