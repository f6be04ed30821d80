"""The security drill's cherry-picker (benchmarks/drill_handbacks.py) generates outside
``Worker._rollout``: it must keep that method's books itself, or the learner takes the groups
it is generating for lost grants and leases them to it again (each generated twice, the second
hand-back and delivery refused ``not_your_group``, the drill's picker 'handed nothing back')."""

import asyncio
from types import SimpleNamespace

from benchmarks import drill_handbacks
from echo import wire
from worker.backends import Sample


class Clock:
    t = 100.0

    def monotonic(self) -> float:
        return self.t


class Backend:
    """Four finished samples per group; generating one grant takes 2 s of the fake clock. It
    records what a work request sent meanwhile would list as held."""

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    tokens_sampled = 0
    base_hash = None  # worker.backends.base.Backend's: no LoRA base held

    def __init__(self, worker, clock):
        self.worker, self.clock, self.held_meanwhile = worker, clock, []

    def generate(self, groups, max_new_tokens, temperature, stop=None):
        self.held_meanwhile.append(list(self.worker._generating))
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


def test_the_picker_lists_its_groups_as_held_and_times_the_real_generation(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(drill_handbacks, "time", SimpleNamespace(monotonic=clock.monotonic))
    w = drill_handbacks._make("cherry_pick")("tcp://127.0.0.1:9", worker_id="picker")
    w.backend, w.adapter, w.client = Backend(w, clock), Adapter(), Client()
    w.view = {"worker": {"max_new_tokens": 4, "temperature": 1.0}, "transport": {"request_timeout_s": 5},
              "model": {"name": "tiny-qwen3"}}
    w.installed_version, w.seen = 3, [0.5] * 9  # median 0.5: the 0.0 group goes back
    groups = [wire.Group(group_id=f"g{i}", prompt_ids=[1, 2], n=4, seed=i, task={"r": r})
              for i, r in enumerate((1.0, 0.0, 0.9))]

    assert asyncio.run(w._rollout(groups)) is True

    assert w.backend.held_meanwhile == [["g0", "g1", "g2"]]  # not []: no lost grant to re-lease
    assert [m.groups for m in w.client.sent] == [["g1"]]
    assert [w._groups_of[b] for b in w.unacked] == [["g0", "g2"]]
    assert w._generating == []
    # the grant's real generation (2 s for 3 groups), not the stash's 0 s
    assert (w._rollout_s, round(w._group_s, 3)) == (2.0, 0.667)


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


def test_the_edge_holder_delivers_when_the_learner_is_at_the_edge_and_installs_meanwhile(monkeypatch):
    clock = Ticking()
    monkeypatch.setattr(drill_handbacks, "time", SimpleNamespace(monotonic=clock.monotonic))
    w = drill_handbacks._make("edge_holder")("tcp://127.0.0.1:9", worker_id="holder")
    w.backend, w.adapter, w.client, w.feed = Backend(w, clock), Adapter(), Client(), Feed()
    w.backend.install = lambda tensors, result, version: None
    w.view = {"worker": {"max_new_tokens": 4, "temperature": 1.0}, "transport": {"request_timeout_s": 5},
              "model": {"name": "tiny-qwen3"}}
    w.installed_version = 3
    g = wire.Group(group_id="g0", prompt_ids=[1, 2], n=4, seed=0, task={"r": 1.0})
    start = clock.t

    async def learner_publishes():
        for v in (4, 5):  # S = 2: version 5 is the edge for a batch generated under 3
            await asyncio.sleep(0.05)
            assert not w.unacked  # held until then
            w._offer(v, {}, None)

    async def both():
        return (await asyncio.gather(w._rollout([g]), learner_publishes()))[0]

    assert asyncio.run(both()) is True

    assert clock.t - start < 60  # not the 60 s give-up
    assert w.installed_version == 4 and w.newest == 5
    batch = next(iter(w.unacked.values()))
    assert {r["version"] for r in wire.unpack_records(batch.payload, 1 << 20)} == {3}  # generated under 3
    assert w.backend.held_meanwhile == [["g0"]] and w._generating == []
