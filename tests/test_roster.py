"""``echo-rl workers`` and ``echo-rl worker ban`` by id, fingerprint or key (issue 30, item 4),
on the files a real control plane writes and the /api/state a real metrics server serves."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.cli.commands import admin
from echo_rl.control.gate import security_dir
from echo_rl.control.parts import Inputs
from echo_rl.control.reputation import Reputation, Verdict
from echo_rl.control.roster import load_roster
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.security import KeyPair, curve_client, fingerprint
from echo_rl.data.adapter import load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]


def awkward_key() -> KeyPair:
    """A key with the characters that break an unquoted shell command."""
    k = KeyPair.generate()
    while not set("&>]") & set(k.text):
        k = KeyPair.generate()
    return k


@pytest.fixture
def fleet(small_cfg, tokenizer, tmp_path):
    """A running control plane with its run folder, and three joined workers: w1, w2 (a key
    with & > or ]), and a third whose id is w1's fingerprint (so that name is ambiguous)."""
    lc = small_cfg.learner
    adapter = load_adapter("toy-add", {}, tokenizer)
    plane = LearnerServer(
        small_cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            run_dir=tmp_path,
            buffer=ReplayBuffer(lc.staleness, small_cfg.buffer.capacity_groups, lc.group_size),
            work=WorkQueue(
                adapter.prompts(random.Random(0)),
                group_size=lc.group_size,
                max_outstanding=8,
                lease_timeout_s=30,
                prefix="t",
            ),
            limits=Limits(24, small_cfg.worker.max_new_tokens, lc.group_size),
        ),
    )
    plane.start()
    keys = {"w1": KeyPair.generate(), "w2": awkward_key()}
    keys[fingerprint(keys["w1"].text)] = KeyPair.generate()
    ctx = zmq.Context()
    try:
        for wid, k in keys.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            curve_client(sock, k, plane.public_key)
            sock.connect(plane.endpoint)
            sock.send(wire.encode(wire.Join(worker_id=wid, price=0.25)))
            assert isinstance(wire.decode(sock.recv(), 1 << 24), wire.JoinAck)
        plane.parts.fleet.books.save(plane.parts.fleet.state())  # what the plane writes every 2 s
        yield plane, tmp_path, {wid: k.text for wid, k in keys.items()}
    finally:
        ctx.destroy(linger=0)
        plane.shutdown("test over")


def listing(capsys, *args):
    rc = admin.main(["workers", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_workers_lists_ids_fingerprints_states_and_quoted_keys_from_the_live_learner(fleet, capsys):
    pytest.importorskip("prometheus_client")
    from echo_rl.core.metrics import LearnerMetrics, LiveSources

    plane, run, keys = fleet
    metrics = LearnerMetrics()
    # as echo_rl/learner/startup.py wires it
    metrics.live = LiveSources(accounts=plane.accounts.export, tree=plane.relay_tree)
    metrics.update({"step": 0}, plane.stats())
    server = metrics.serve("127.0.0.1", 0)
    try:
        (run / "learner.json").write_text(json.dumps({"metrics": server.url}))
        out, err = listing(capsys, "--run-dir", str(run))
        rows = [
            json.loads(x) for x in listing(capsys, "--run-dir", str(run), "--json")[0].splitlines()
        ]
    finally:
        server.close()
    assert f"live from the learner at {server.url}" in err
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert set(lines) == set(keys)
    for wid, key in keys.items():
        # the last field is the key, quoted so that a shell gives it back whole
        assert shlex.split(lines[wid])[-1] == key and fingerprint(key) in lines[wid]
    assert shlex.quote(keys["w2"]).startswith("'")
    by_id = {r["worker_id"]: r for r in rows}
    assert {r["state"] for r in rows} <= {"active", "standby"}
    assert by_id["w1"]["transport"] == "tcp" and by_id["w1"]["accepted"] == 0
    assert by_id["w2"]["key"] == keys["w2"] and by_id["w2"]["price"] == 0.25
    # the relay tree's view: joined, nothing published yet, so in no plan
    assert {r["role"] for r in rows} == {"unplaced"} and {r["parent"] for r in rows} == {""}
    assert out.splitlines()[0].split()[4:8] == ["PARENT", "ROLE", "TRANSPORT", "MBIT_DOWN/UP"]
    assert lines["w1"].split()[4:8] == ["-", "unplaced", "tcp", "-"]


def test_ban_by_id_fingerprint_or_key_and_refusals_in_words(fleet, capsys):
    plane, run, keys = fleet
    plane.shutdown("test over")  # fleet.json is written at shutdown too
    bans = security_dir(run) / "bans.txt"
    twin = fingerprint(keys["w1"])  # an id and a fingerprint at once

    def ban(who):
        rc = admin.main(["worker", "ban", who, "--run-dir", str(run), "--reason", "test"])
        return rc, capsys.readouterr().err

    rc, err = ban("w2")
    assert rc == 0 and keys["w2"] in bans.read_text() and fingerprint(keys["w2"]) in err
    assert shlex.quote(keys["w2"]) in err
    rc, err = ban(twin)
    assert rc == 2 and "names 2 workers" in err and "full key" in err
    assert keys["w1"] not in bans.read_text()
    rc, err = ban("nobody")
    assert (
        rc == 2 and "no worker with id or fingerprint 'nobody'" in err and "echo-rl workers" in err
    )
    rc, err = ban(fingerprint(keys[twin]))  # the third worker, by its fingerprint
    assert rc == 0 and keys[twin] in bans.read_text()
    rc, err = ban(keys["w1"])  # a full key is taken as it is
    assert rc == 0 and keys["w1"] in bans.read_text()
    rows = {
        r["worker_id"]: r
        for r in map(
            json.loads,
            listing(capsys, "--run-dir", str(run), "--offline", "--json")[0].splitlines(),
        )
    }
    assert {r["state"] for r in rows.values()} == {"banned"} and rows["w2"]["note"] == "test"


def test_the_run_folder_alone_gives_quarantines_strikes_and_says_the_learner_is_silent(
    fleet, capsys
):
    plane, run, keys = fleet
    plane.shutdown("test over")
    rep = Reputation(security_dir(run), strikes=3, step=lambda: 7)
    rep.record(Verdict("w2", keys["w2"], "g1", 0, "reward", False, {}))  # as the learner writes
    rep.record(Verdict("w2", keys["w2"], "g2", 0, "reward", True, {}))
    rep.quarantine("w1", keys["w1"], "3 failed checks, the last: logprob")
    (run / "learner.json").write_text(json.dumps({"metrics": "http://127.0.0.1:1"}))  # nobody
    out, err = listing(capsys, "--run-dir", str(run), "--json")
    rows = {r["worker_id"]: r for r in map(json.loads, out.splitlines())}
    assert "did not answer" in err and "from the run folder only" in err
    assert rows["w1"]["state"] == "quarantined" and "logprob" in rows["w1"]["note"]
    assert rows["w2"]["strikes"] == 1 and rows["w2"]["state"] == "unknown"
    assert load_roster(run, live=False).find("w1").key == keys["w1"]
    assert admin.main(["workers", "--run-dir", str(run / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_help_is_instant():
    code = (
        "import sys, contextlib, io\n"
        "import echo_rl.cli.rl\n"
        "for argv in (['workers', '--help'], ['worker', 'ban', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        echo_rl.cli.rl.main(argv)\n"
        "heavy = [m for m in ('torch', 'transformers', 'zmq', 'pydantic') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0, r.stderr


def test_parents_roles_and_links_come_from_the_served_tree_which_is_validated():
    from echo_rl.control.roster import Entry, _tree

    rows = {"a": Entry("a", ""), "b": Entry("b", "", down_mbit=51.2, up_mbit=0.0)}
    node = {
        "worker": "b",
        "parent": "a",
        "source": "tcp://h:1",
        "role": "tail",
        "children": 0,
        "transport": "punched",
        "nat": "punchable",
        "relay_endpoint": "",
    }
    notes: list[str] = []
    _tree({"tree": {"version": 3, "source": "tcp://l:1", "nodes": [node]}}, rows, notes)
    assert (rows["b"].parent, rows["b"].role, rows["b"].links) == ("a", "tail", "51/0")
    assert rows["a"].links == "" and not notes
    _tree(
        {"tree": {"version": 3, "source": "tcp://l:1", "nodes": [{**node, "role": "boss"}]}},
        rows,
        notes,
    )
    assert "did not validate" in notes[0]


def test_transport_comes_from_the_same_tree_as_parent_and_role():
    """Issue 55, item 4: the workers list said "punched" while the tree said PARENT learner,
    ROLE head; the three now come from one plan."""
    from echo_rl.control.roster import Entry, _tree

    rows = {"h": Entry("h", "", transport="punched")}  # as the workers list had it
    head = {
        "worker": "h",
        "parent": "learner",
        "source": "tcp://l:2",
        "role": "head",
        "children": 1,
        "transport": "tcp",
        "nat": "punchable",
        "relay_endpoint": "tcp://h:5560",
    }
    _tree({"tree": {"version": 4, "source": "tcp://l:2", "nodes": [head]}}, rows, [])
    assert (rows["h"].parent, rows["h"].role, rows["h"].transport) == ("learner", "head", "tcp")
