"""The README's "Running for real" block is the test (issue 30, item 7).

In network namespaces (labs/natlab.py): a bridge as the internet, the learner's cloud host on
a private address (10.0.0.2) behind a 1:1 NAT that holds its public address (198.51.100.1),
lets in only TCP 5555-5558 and does not loop back (issue 55: most clouds), one public
volunteer (198.51.100.100), two behind MASQUERADE home routers and one behind a
``--random-fully`` (symmetric) router. The block is
read from README.md at test time (tests/readme_run.py) and each command runs as written on the
host it is meant for, with only the operator's placeholders put in: HOST, the learner key,
TOKEN, PUBLIC_IP, the id to ban, and the tiny model with sizes for 2 CPU cores
(``SIZING``). Checked: the learner starts and prints the join line; a token; ``echo-rl doctor``
on the learner's host says it cannot see its public address from there before a volunteer
joined and passes on what the learner saw after, ``echo-worker doctor`` on every volunteer's
passes, each NAT told apart, and the doctor fails a config that tells workers the host's
private address; four volunteers join; learner steps advance; ``echo-rl workers`` shows the NAT'd
volunteers punchable and one of them fetching through a punched link; ``echo-worker status``
on each; the id ``echo-rl workers`` printed bans a volunteer, which stops and says so while
steps go on; a DROP on the snapshot port makes both doctors fail naming the port and the fix,
on the host's firewall and in the cloud's security group (where only the learner's view shows
it);
SIGTERM writes summary.json and the README's resume line continues the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import readme_run as rr

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SIZING = (
    "adapter.options.path=examples/data/arith.jsonl",
    "learner.prompts_per_step=2",
    "learner.group_size=4",
    "learner.updates_per_step=1",
    "worker.max_new_tokens=16",
    "learner.torch_threads=1",
    "worker.torch_threads=1",
    "learner.max_steps=100000",
)
LEARNER = "198.51.100.1"  # labs.natlab.ROOT_ADDR: the cloud gateway's public address
PUBLIC_VOLUNTEER = "198.51.100.100"


def _why_not() -> str:
    from labs import natlab

    if os.geteuid() != 0:
        return "needs root to build network namespaces and NAT routers"
    if natlab.missing_tools():
        return f"NAT lab: {natlab.missing_tools()}"
    if shutil.which("echo-rl", path=str(VENV_BIN)) is None:
        return f"echo-rl is not installed next to {sys.executable} (pip install -e .)"
    return ""


# ----------------------------------------------------------------------------- the parser


def test_the_block_parses_into_the_commands_the_run_needs():
    got = rr.steps((ROOT / "README.md").read_text())
    kinds = [s.kind for s in got]
    assert set(rr.NEEDED) <= set(kinds)
    learn = rr.one(got, "learn")
    assert "examples/public.toml" in learn.words and learn.text.lstrip().startswith("echo-rl learn")
    assert (
        (ROOT / "README.md")
        .read_text()
        .splitlines()[learn.line - 1]
        .lstrip()
        .startswith("echo-rl learn")
    )


def test_a_broken_or_unknown_command_is_reported_with_its_line():
    readme = (ROOT / "README.md").read_text()
    ban = rr.one(rr.steps(readme), "ban")
    lines = readme.splitlines()
    lines[ban.line - 1] = lines[ban.line - 1].replace("echo-rl worker ban", "echo-rl workers-ban")
    with pytest.raises(rr.ReadmeError, match=rf"README.md line {ban.line}: echo-rl workers-ban"):
        rr.steps("\n".join(lines))
    lines[ban.line - 1] = "# " + lines[ban.line - 1]  # the ban line commented out
    with pytest.raises(rr.ReadmeError, match="lacks a command for: ban"):
        rr.steps("\n".join(lines))
    with pytest.raises(rr.ReadmeError, match="not shell words"):
        rr.steps(readme.replace("--uses 10", "--uses '10", 1))


def test_placeholders_are_the_only_words_put_in():
    got = rr.steps((ROOT / "README.md").read_text())
    ph = rr.Placeholders(
        LEARNER,
        PUBLIC_VOLUNTEER,
        "tiny-qwen3",
        learner_key="K" * 64,
        token="T0K",
        ban="w-00000000",
        extra_sets=SIZING,
    )
    join = ph.argv(rr.one(got, "join_public"))
    assert f"echo://{LEARNER}:5555/{'K' * 64}?token=T0K" in join and PUBLIC_VOLUNTEER in join
    learn = ph.argv(rr.one(got, "learn"))
    assert f"learner.public_host={LEARNER}" in learn and "model.name=tiny-qwen3" in learn
    assert ph.argv(rr.one(got, "ban"))[3] == "w-00000000"
    for s in got:  # nothing else changes: every other word is the README's
        if s.kind not in ("learn", "ban"):
            assert len(ph.argv(s)) == len(s.words)


# ----------------------------------------------------------------------------- the lab


class Lab:
    """The hosts and the README's placeholders for one run of the block."""

    def __init__(self, tmp: Path, names):
        from labs import natlab

        self.nodes = [
            natlab.Node(0, "public", names),
            natlab.Node(1, "cone", names),
            natlab.Node(2, "cone", names),
            natlab.Node(3, "symmetric", names),
        ]
        self.dc = rr.Host("data-center", names.root, tmp / "dc")
        self.volunteers = {
            n.nat + (str(n.index) if n.nat == "cone" else ""): rr.Host(
                f"volunteer {n.index} ({n.nat}, {n.address})", n.ns, tmp / f"v{n.index}"
            )
            for n in self.nodes
        }
        for h in [self.dc, *self.volunteers.values()]:
            h.folder.mkdir(parents=True)
        (self.dc.folder / "examples").symlink_to(ROOT / "examples")  # the repo's examples/
        self.run_dir = self.dc.folder / "runs" / "r1"  # what `--run-dir runs/r1` names there
        self.hosts = rr.Hosts(VENV_BIN)
        self.ph = rr.Placeholders(LEARNER, PUBLIC_VOLUNTEER, "tiny-qwen3", extra_sets=SIZING)

    def steps_done(self) -> int:
        try:
            rows = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        return len([r for r in rows if r.strip()])

    def worker_ids(self) -> dict[str, str]:
        """Each volunteer's worker id, from its own status folder (~/.local/state/echo/workers)."""
        out = {}
        for name, h in self.volunteers.items():
            found = sorted((h.folder / "home/.local/state/echo/workers").glob("*.json"))
            if found:
                out[name] = found[0].stem
        return out


def _table(stdout: str) -> dict[str, dict[str, str]]:
    """`echo-rl workers`' table by worker id."""
    lines = [x for x in stdout.splitlines() if x.strip()]
    if not lines or not lines[0].startswith("ID"):
        return {}
    heads = lines[0].split()
    return {cols[0]: dict(zip(heads, cols)) for cols in (x.split() for x in lines[1:])}


def _run_block(tmp: Path, readme: str) -> dict:
    """Every command of the block on its host; returns what the assertions below need."""
    from labs import natlab

    tag = f"{os.getpid() % 100000}"
    names = natlab.Names(ns=f"rdm{tag}-", dev=f"rd{tag}")
    all_steps = rr.steps(readme)
    lab = Lab(tmp, names)
    seen: dict = {"skipped": [s.where() for s in all_steps if s.kind == "torchrun"]}
    with natlab.lab(lab.nodes, 0, 0, names, cloud_nat=True):
        try:
            _learner_to_joins(lab, readme, all_steps, seen)
            _fleet_at_work(lab, all_steps, seen)
            _ban_and_closed_port(lab, all_steps, seen)
            _stop_and_resume(lab, all_steps, seen)
        finally:
            lab.hosts.stop_all()
            seen["commands"] = lab.hosts.log
            (tmp / "seen.json").write_text(json.dumps(seen, indent=1, default=str))
    return seen


def _learner_to_joins(lab: Lab, readme: str, all_steps, seen) -> None:
    hosts, ph = lab.hosts, lab.ph
    learn = rr.one(all_steps, "learn")
    hosts.start(lab.dc, learn, ph.argv(learn), "learner")
    line = rr.wait_for(
        "the learner's join line",
        lambda: rr.ready_line(lab.dc.folder / "learner.log"),
        120,
        alive=[lambda: hosts.alive("learner")],
    )
    seen["learner_line"] = line
    ph.learner_key = line.rsplit("/", 1)[1]
    claim = rr.said(readme, "prints the join line:")  # the README's comment on what it prints
    seen["join_claim"] = (claim, ph.fill(claim))
    seen["learner_printed"] = rr.tail(lab.dc.folder / "learner.log", 1 << 20)
    token = rr.one(all_steps, "token")
    done = hosts.run(lab.dc, token, ph.argv(token))
    ph.token = done.stdout.strip()
    seen["token_says"] = done.stderr
    rl_doctor = rr.one(all_steps, "rl_doctor")
    seen["rl_doctor"] = hosts.run(lab.dc, rl_doctor, ph.argv(rl_doctor)).stdout
    # the wrong set-up: the host's own (private) address handed out, no public_host
    wrong = [*ph.argv(rl_doctor), "--set", "learner.host=10.0.0.2", "--set", "learner.public_host="]
    seen["rl_doctor_wrong"] = hosts.run(lab.dc, rl_doctor, wrong, expect=1).stdout
    wd = rr.one(all_steps, "worker_doctor")
    seen["worker_doctor"] = {
        name: hosts.run(h, wd, ph.argv(wd)).stdout for name, h in lab.volunteers.items()
    }
    public = rr.one(all_steps, "join_public")
    hosts.start(lab.volunteers["public"], public, ph.argv(public), "public")
    home = rr.one(all_steps, "join_home")
    for name in ("cone1", "cone2", "symmetric"):
        hosts.start(lab.volunteers[name], home, ph.argv(home), name)


def _alive(lab: Lab, *gone: str):
    """Checks that raise, naming its README line, when a process that should run has ended."""
    return [lambda n=n: lab.hosts.alive(n) for n in ("learner", *lab.volunteers) if n not in gone]


def _fleet_at_work(lab: Lab, all_steps, seen) -> None:
    hosts, ph = lab.hosts, lab.ph
    rr.wait_for("3 learner steps", lambda: lab.steps_done() >= 3, 150, alive=_alive(lab))
    ids = rr.wait_for(
        "every volunteer's status file", lambda: len(lab.worker_ids()) == 4 and lab.worker_ids(), 30
    )
    workers = rr.one(all_steps, "workers")

    def punched():
        table = _table(hosts.run(lab.dc, workers, ph.argv(workers)).stdout)
        rows = [table.get(ids[n], {}) for n in ("cone1", "cone2")]
        ok = (
            all(r.get("NAT") == "punchable" for r in rows)
            and any(r.get("TRANSPORT") == "punched" for r in rows)
            and table.get(ids["symmetric"], {}).get("NAT") == "none"
            and table.get(ids["public"], {}).get("NAT") == "reachable"
        )
        return table if ok else None

    seen["table"] = rr.wait_for(
        "`echo-rl workers` to show the NAT'd volunteers punchable, one of them on a punched link",
        punched,
        120,
        every=2,
        alive=_alive(lab),
    )
    seen["ids"] = ids
    rl_doctor = rr.one(all_steps, "rl_doctor")  # again, now that volunteers have joined
    seen["rl_doctor_joined"] = hosts.run(lab.dc, rl_doctor, ph.argv(rl_doctor)).stdout
    status = rr.one(all_steps, "status")
    seen["status"] = {
        n: hosts.run(h, status, ph.argv(status)).stdout for n, h in lab.volunteers.items()
    }


def _ban_and_closed_port(lab: Lab, all_steps, seen) -> None:
    hosts, ph, ids = lab.hosts, lab.ph, seen["ids"]
    ban = rr.one(all_steps, "ban")
    ph.ban = ids["symmetric"]  # the id `echo-rl workers` printed for it
    seen["ban_says"] = hosts.run(lab.dc, ban, ph.argv(ban)).stderr
    before = lab.steps_done()
    sym = hosts.group.procs["symmetric"]
    rr.wait_for("the banned volunteer to stop", lambda: sym.poll() is not None, 60)
    seen["banned_exit"] = sym.returncode
    seen["banned_log"] = rr.tail(lab.volunteers["symmetric"].folder / "symmetric.log")
    status = rr.one(all_steps, "status")
    seen["banned_status"] = hosts.run(lab.volunteers["symmetric"], status, ph.argv(status)).stdout
    rr.wait_for(
        "2 more steps after the ban",
        lambda: lab.steps_done() >= before + 2,
        120,
        alive=_alive(lab, "symmetric"),
    )
    workers = rr.one(all_steps, "workers")
    seen["table_after_ban"] = _table(hosts.run(lab.dc, workers, ph.argv(workers)).stdout)
    # a firewall on the learner's host drops the snapshot port: both doctors say so
    drop = ["iptables", "-I", "INPUT", "-p", "tcp", "--dport", "5556", "-j", "DROP"]
    log = lab.dc.folder / "learner.log"
    said_before = log.read_text().count("snapshot port 5556")
    subprocess.run(["ip", "netns", "exec", lab.dc.ns, *drop], check=True)
    dropped = time.monotonic()
    try:
        rl_doctor, wd = rr.one(all_steps, "rl_doctor"), rr.one(all_steps, "worker_doctor")
        seen["rl_doctor_closed"] = hosts.run(lab.dc, rl_doctor, ph.argv(rl_doctor), expect=1).stdout
        seen["worker_doctor_closed"] = hosts.run(
            lab.volunteers["cone1"], wd, ph.argv(wd), expect=1
        ).stdout
        # ... and the learner names the port from its workers' failed fetches
        try:  # a miss fails its own test below, not the whole run's
            rr.wait_for(
                "the learner to name its dropped snapshot port",
                lambda: log.read_text().count("snapshot port 5556") > said_before,
                40,
                every=0.25,
            )
            seen["port_named_s"] = time.monotonic() - dropped
        except AssertionError:
            seen["port_named_s"] = None
        seen["port_named_line"] = next(
            (x for x in log.read_text().splitlines()[::-1] if "snapshot port 5556" in x), ""
        )
    finally:
        subprocess.run(["ip", "netns", "exec", lab.dc.ns, "iptables", "-D", *drop[2:]], check=True)
    # the cloud's security group stops letting 5556 in: this host still reaches its own port,
    # and only the learner's view of its workers' failed fetches shows it
    from labs import natlab

    gw = natlab.Names(ns=lab.dc.ns.removesuffix("pub")).gateway
    group = ["iptables", "-I", "FORWARD", "-i", "wan", "-p", "tcp", "--dport", "5556", "-j", "DROP"]
    rr.wait_for(  # the host firewall's reports age out of the learner's window first
        "the learner's word on the host firewall's drop to end",
        lambda: not _port_verdict(lab),
        90,
        every=1,
    )
    subprocess.run(["ip", "netns", "exec", gw, *group], check=True)
    try:
        rr.wait_for(
            "the learner to name the port closed in the security group",
            lambda: _port_verdict(lab),
            60,
            every=0.5,
        )
        rl_doctor = rr.one(all_steps, "rl_doctor")
        seen["rl_doctor_group"] = hosts.run(lab.dc, rl_doctor, ph.argv(rl_doctor), expect=1).stdout
    finally:
        subprocess.run(["ip", "netns", "exec", gw, "iptables", "-D", *group[2:]], check=True)


_ASK = """
import asyncio, json, sys
from echo_rl.core.doctor import ask_learner
from echo_rl.core.security import KeyPair
info = json.load(open(sys.argv[1]))
local = "tcp://127.0.0.1:%d" % info["ports"]["control"]
reply, why = asyncio.run(ask_learner(local, info["public_key"].encode(), KeyPair.generate()))
print(getattr(reply, "snapshot_path", "") or "-")
"""


def _port_verdict(lab: Lab) -> bool:
    """The learner, asked on its host as `echo-rl doctor` asks it (wire.DoctorAck), says its
    workers report the snapshot port (echo_rl/control/snapshot_path.py)."""
    argv = ["ip", "netns", "exec", lab.dc.ns, sys.executable, "-c", _ASK]
    done = subprocess.run(
        [*argv, str(lab.run_dir / "learner.json")],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=30,
    )
    return "snapshot port 5556" in done.stdout


def _stop_and_resume(lab: Lab, all_steps, seen) -> None:
    """The README's resume line is for "after a crash": the learner is killed (SIGKILL), the
    volunteers wait for it, the line brings it back on the same key and ports, and they go on
    with it. Then SIGTERM ends the run: summary.json, and the volunteers are told."""
    hosts, ph = lab.hosts, lab.ph
    hosts.group.stop("learner", sig=signal.SIGKILL)
    before = lab.steps_done()
    resume = rr.one(all_steps, "resume")
    (lab.dc.folder / "learner.log").rename(lab.dc.folder / "learner-crashed.log")
    hosts.start(lab.dc, resume, ph.argv(resume), "learner")
    seen["resumed_line"] = rr.wait_for(
        "the resumed learner's join line",
        lambda: rr.ready_line(lab.dc.folder / "learner.log"),
        120,
        alive=[lambda: hosts.alive("learner")],
    )
    rr.wait_for(
        "2 steps after --resume",
        lambda: lab.steps_done() >= before + 2,
        150,
        alive=_alive(lab, "symmetric"),
    )
    seen["steps"] = (before, lab.steps_done())
    seen["learner_exit"] = hosts.stop("learner")
    seen["learner_tail"] = rr.tail(lab.dc.folder / "learner.log", 6000)
    summary = lab.run_dir / "summary.json"
    seen["summary"] = json.loads(summary.read_text()) if summary.is_file() else None
    for name in ("public", "cone1", "cone2"):
        proc = hosts.group.procs[name]
        rr.wait_for(
            f"the {name} volunteer to leave with the learner",
            lambda p=proc: p.poll() is not None,
            30,
        )
    seen["told"] = {
        n: rr.tail(lab.volunteers[n].folder / f"{n}.log") for n in ("public", "cone1", "cone2")
    }


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    return _run_block(tmp_path_factory.mktemp("readme"), (ROOT / "README.md").read_text())


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_block_runs_as_written_across_nat(readme_run):
    seen = readme_run
    line = seen["learner_line"]
    assert line.startswith(f"echo://{LEARNER}:5555/")
    claim, filled = seen["join_claim"]
    assert claim, "README 'Running for real' no longer says what the learner prints"
    assert filled in seen["learner_printed"], (claim, seen["learner_printed"][:2000])
    assert f"echo-worker join '{line}?token=" in seen["token_says"]
    ports = ("learner.port", "learner.chunk_port", "learner.reflector_ports[0]")
    ports += ("learner.reflector_ports[1]",)
    # Before any volunteer joined, the learner's host cannot see its public address the way
    # workers do (no hairpin): each port says so, and who can tell; no failure, no `ufw`.
    first = seen["rl_doctor"]
    for key in ports:
        assert f"[skip] {key}: bound on 127.0.0.1; {LEARNER} is not an address" in first, first
    assert "[ok  ] metrics.port:" in first and "ufw" not in first and "[FAIL]" not in first
    # Once they joined, it passes on what the learner saw of them.
    joined = seen["rl_doctor_joined"]
    for key in ports:
        line = next(x for x in joined.splitlines() if f"] {key}:" in x)
        assert line.startswith(f"[ok  ] {key}: ") and "worker(s) from outside" in line, joined
    assert "[ok  ] learner: answers at tcp://127.0.0.1:5555" in joined, joined
    # The wrong set-up (the host's private address handed out) fails, naming it.
    wrong = seen["rl_doctor_wrong"]
    assert "[FAIL] public address: workers are told 10.0.0.2, a private address" in wrong
    assert "learner.public_host" in wrong, wrong
    doc = seen["worker_doctor"]
    for name, out in doc.items():
        assert "[ok  ] learner port" in out and "[ok  ] snapshot port" in out, (name, out)
    assert "[ok  ] NAT: punchable" in doc["cone1"] and "[ok  ] NAT: punchable" in doc["cone2"]
    assert "[warn] NAT: symmetric NAT" in doc["symmetric"]
    assert "learner.public_host" not in json.dumps(doc)  # nothing advertised a bad address


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nat_d_volunteers_relay_through_punched_links_and_the_operator_sees_it(readme_run):
    table, ids = readme_run["table"], readme_run["ids"]
    assert len(table) >= 4
    assert table[ids["public"]]["NAT"] == "reachable"
    assert table[ids["symmetric"]]["NAT"] == "none"
    assert any(table[ids[n]]["TRANSPORT"] == "punched" for n in ("cone1", "cone2"))
    nat = {"public": "reachable", "cone1": "punchable", "cone2": "punchable", "symmetric": "none"}
    for name, out in readme_run["status"].items():  # `echo-worker status` on each host
        rows = {
            x.split("│")[1].strip(): x.split("│")[2].strip()
            for x in out.splitlines()
            if x.count("│") >= 3 and x.split("│")[1].strip()
        }
        assert rows.get("worker") == ids[name] and rows.get("NAT") == nat[name], (name, out)
        assert rows.get("state", "").split(" ")[0] in ("active", "standby"), (name, out)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_volunteer_banned_by_the_id_the_operator_sees_stops_and_the_run_goes_on(readme_run):
    seen = readme_run
    sym = seen["ids"]["symmetric"]
    assert f"banned {sym}" in seen["ban_says"]
    assert seen["table_after_ban"][sym]["STATE"] == "banned"
    status = seen["banned_status"]  # `echo-worker status` on the banned volunteer's host
    assert "quarantined, exited" in status and "banned by the operator" in status, status
    assert seen["banned_exit"] != 0


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dropped_snapshot_port_fails_both_doctors_with_the_fix(readme_run):
    rl, wk = readme_run["rl_doctor_closed"], readme_run["worker_doctor_closed"]
    check = "\n".join(x for x in rl.splitlines() if "learner.chunk_port" in x or "fix:" in x)
    assert "[FAIL] learner.chunk_port" in rl and "a firewall on this host drops" in rl, rl
    assert "ufw allow 5556/tcp" in rl and "start it" not in check, rl  # it is running
    assert rl.count("[FAIL]") == 1, rl  # the other ports are fine
    snap = [x for x in wk.splitlines() if "snapshot port" in x]
    assert snap and "[FAIL]" in snap[0] and "a firewall drops the connection" in snap[0], wk
    assert "opens TCP 5556" in wk and "learner.chunk_port" in wk


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_port_closed_in_the_cloud_s_security_group_fails_the_doctor_on_the_learner_s_word(
    readme_run,
):
    """The learner's host still reaches its own 5556; only the workers' failed fetches show
    the security group dropping it, and the doctor passes on the learner's words."""
    rl = readme_run["rl_doctor_group"]
    check = "\n".join(x for x in rl.splitlines() if "learner.chunk_port" in x or "fix:" in x)
    assert "[FAIL] learner.chunk_port" in rl and "the learner says:" in check, rl
    assert "snapshot port 5556" in check and "security group" in check, rl
    assert "ufw" not in check and rl.count("[FAIL]") == 1, rl


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dropped_snapshot_port_is_named_by_the_learner_within_15_s(readme_run):
    """Issue 55: with 5556 dropped the learner logged stale drops and advised raising kappa;
    only the workers named the port, after 60 s. Its log now names the port and the fix."""
    line, took = readme_run["port_named_line"], readme_run["port_named_s"]
    assert took is not None and took <= 15, (took, line)
    assert "Open TCP 5556" in line and "report that they cannot fetch snapshots" in line, line


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_s_resume_after_a_crash_continues_and_sigterm_writes_the_summary(readme_run):
    seen = readme_run
    before, after = seen["steps"]
    assert after >= before + 2  # the same volunteers, on the same key and port
    assert seen["resumed_line"] == seen["learner_line"]
    # echo-rl learn: interrupted, as after Ctrl-C
    assert seen["learner_exit"] == 130, seen["learner_tail"]
    assert seen["summary"] is not None and seen["summary"]["steps"] >= after - 1, seen["summary"]
    assert "signal" in seen["summary"]["ended"] or "stop" in seen["summary"]["ended"], seen[
        "summary"
    ]
    for name, log in seen["told"].items():
        assert "learner stopped" in log, (name, log)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_broken_readme_line_fails_the_run_naming_it(tmp_path):
    """The runner on a copy of the README whose learner line lost `learner.public_host=HOST`:
    the learner refuses to start (bound on 0.0.0.0, it would hand out an address nobody can
    use) and the failure names the README line and the learner's words."""
    why = _why_not()
    if why:
        pytest.skip(why)
    readme = (ROOT / "README.md").read_text()
    learn = rr.one(rr.steps(readme), "learn")
    broken = readme.replace("--set learner.public_host=HOST", "", 1)
    with pytest.raises(rr.ReadmeStepError) as err:
        _run_block(tmp_path, broken)
    text = str(err.value)
    assert f"README.md line {learn.line}: echo-rl learn examples/public.toml" in text, text
    assert "learner.public_host" in text.split("exited", 1)[1], text
