"""``make gpu-check``: every GPU figure in one prepared call, written as JSON and a log.

A GPU machine is lent now and then, for minutes, and reaches nothing: this script is ready
before one is. On that machine it

1. installs the wheels ``make gpu-wheels`` put in ``.whl/`` into a temporary site folder
   (Echo's own adapters are registered there as entry points, as ``pip install -e .`` would);
2. stashes the SmolLM2 GGUF parts ``make gpu-weights`` put in ``.gpu/`` outside the checkout
   (a part per call: the weights are larger than one call may carry) and joins them once every
   part is there and the SHA-256 matches;
3. runs the stages of ``benchmarks/gpu_stages.py`` one by one, each in its own process under
   its own time budget (BUDGETS), so one slow stage cannot eat the others; a stage stopped at
   its budget keeps what it had measured;
4. writes ``gpu_check.json`` (machine, every stage's figures and outcome), ``gpu_check.log``
   and ``learning_curve.png`` into ``--out`` (the device's ``$OUT`` by default), and prints
   a table.

    python3 benchmarks/gpu_suite.py [--out DIR] [--stages model,tests,...] [--dry-run]

``--dry-run`` runs every stage on the CPU with the tiny model (``make test`` does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from echo_rl.core.steprow import COL  # noqa: E402

ORDER = ("model", "tests", "learner", "generation", "residency", "relay", "learning")
# Seconds per stage on the GPU: 9 minutes at most, inside the device's 10-minute command limit.
# The second H200 run (benchmarks/results/gpu/h200-run2/) took 44 s to import, 38 s for the
# tests, 25 s for the learner, 65 s for generation and 14 s for the relay, so learning gets what
# the others leave: the whole suite took about 5 minutes with learning at 140 s. The budgets sum
# to 590 s, inside one call's 600. The third run (h200-run3/) took 44 s for the residency stage,
# which builds a 3B model. Generation runs both backends side by side since issue 49
# (benchmarks/gen_speed.py, batch 256 added): residency and relay give it 40 s. Issue 50 adds
# three learner cases (the unfused head twice, SmolLM2 compiled): residency gives it 20 s.
BUDGETS = {
    "model": 50,
    "tests": 60,
    "learner": 80,
    "generation": 150,
    "residency": 50,
    "relay": 40,
    "learning": 160,
}
DRY_BUDGETS = {
    "model": 30,
    "tests": 60,
    "learner": 120,
    "generation": 90,
    "residency": 60,
    "relay": 60,
    "learning": 150,
}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or ROOT / "benchmarks/results/gpu/latest"),
    )
    p.add_argument(
        "--stages", default=",".join(ORDER), help=f"comma-separated, of {','.join(ORDER)}"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="every stage on the CPU with the tiny model"
    )
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    p.add_argument("--site", type=Path, default=Path("/tmp/echo-site"))
    p.add_argument(
        "--weights",
        type=Path,
        nargs="*",
        help="the GGUF part folders this call carries (default: every .gpu/part*)",
    )
    p.add_argument(
        "--stash",
        type=Path,
        default=Path.home() / ".cache" / "echo-gpu",
        help="where parts wait for the rest (outside the checkout: it survives between calls)",
    )
    p.add_argument("--steps", type=int, default=60, help="learning run: learner steps")
    a = p.parse_args(argv)
    a.stages = [s for s in a.stages.split(",") if s]
    bad = sorted(set(a.stages) - set(ORDER))
    if bad:
        p.error(f"--stages: unknown {bad}; choose from {','.join(ORDER)}")
    return a


# ------------------------------------------------------------------------------ set-up


def install_wheels(wheels: Path, site: Path) -> dict[str, Any]:
    """The carried wheels into ``site`` (once per set of wheels), and Echo's entry points."""
    found = sorted(p.name for p in wheels.glob("*.whl")) if wheels.is_dir() else []
    marker = site / ".echo-wheels"
    if found and not (marker.is_file() and marker.read_text() == "\n".join(found)):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *map(str, sorted(wheels.glob("*.whl"))),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            return {"wheels": found, "error": run.stderr[-2000:]}
        marker.write_text("\n".join(found))
    from echo_rl.data.testing import write_entry_points

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "echo_rl.adapters"
    ]
    write_entry_points(site, "echo-rl", eps)
    return {"wheels": found, "site": str(site)}


def stash_weights(carried: list[Path], stash: Path) -> dict[str, Any]:
    """Keep this call's GGUF parts; the joined GGUF once all parts of the manifest are in."""
    stash.mkdir(parents=True, exist_ok=True)
    for folder in carried:
        man_path = folder / "manifest.json"
        if man_path.is_file():
            shutil.copy2(man_path, stash / "manifest.json")
            for part in folder.glob("*.part*"):
                shutil.copy2(part, stash / part.name)
    target = stash / GGUF_NAME
    if target.is_file():
        return {"gguf": str(target), "state": "joined earlier"}
    if not (stash / "manifest.json").is_file():
        return {"state": "no parts carried (make gpu-weights)"}
    man = json.loads((stash / "manifest.json").read_text())
    missing = [p for p in man["parts"] if not (stash / p).is_file()]
    if missing:
        return {"state": f"waiting for {missing}: carry them in the next call"}
    digest = hashlib.sha256()
    with open(target.with_suffix(".partial"), "wb") as out:
        for name in man["parts"]:
            data = (stash / name).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != man["sha256"]:
        return {"state": "parts joined but SHA-256 differs: carry them again"}
    target.with_suffix(".partial").rename(target)
    return {"gguf": str(target), "state": "joined"}


def machine() -> dict[str, Any]:
    import torch

    from echo_rl.core.machine import machine_info

    info = machine_info()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda=torch.version.cuda,
            gpu=props.name,
            gpu_mem_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
    smi = shutil.which("nvidia-smi")
    if smi:
        run = subprocess.run(
            [
                smi,
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        )
        info["nvidia_smi"] = run.stdout.strip()
    return info


# ------------------------------------------------------------------------------ stages


def _tee(stream: Any, log: Any) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
        log.flush()


def run_stage(
    stage: str, a: argparse.Namespace, env: dict[str, str], tmp: Path, log: Any
) -> dict[str, Any]:
    budget = (DRY_BUDGETS if a.dry_run else BUDGETS)[stage]
    out = tmp / f"{stage}.json"
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_stages.py"),
        stage,
        "--json",
        str(out),
        "--steps",
        str(a.steps),
        "--budget-s",
        str(budget - 25),
    ]
    if a.dry_run:
        argv.append("--dry-run")
    if (a.stash / GGUF_NAME).is_file():
        argv += ["--gguf", str(a.stash / GGUF_NAME)]
    banner = f"\n==== {stage} (budget {budget} s) ====\n"
    sys.stdout.write(banner)
    log.write(banner)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    reader = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and everything it started
        proc.wait()
        rc = None
    reader.join(timeout=5)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["outcome"] = "timed out" if rc is None else "ok" if rc == 0 else f"failed (exit {rc})"
    if rc == 0 and res.get("failed"):
        res["outcome"] = f"{res['failed']} failed"
    elif rc == 0 and res.get("returncode") and not (res["returncode"] == 5 and res.get("skipped")):
        # pytest itself failed (a conftest that cannot import); 5 with skips is every module
        # skipping itself, as on a machine without CUDA
        res["outcome"] = f"failed (pytest exit {res['returncode']})"
    return res


def plot_curve(curve: list[dict[str, Any]], path: Path) -> bool:
    rows = [r for r in curve if r.get(COL.reward_mean) is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows]
    rewards = [r[COL.reward_mean] for r in rows]
    k = 5
    smooth = [
        sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
        for i in range(len(rewards))
    ]
    ax.plot(steps, rewards, alpha=0.35, label="reward per step")
    ax.plot(steps, smooth, label=f"mean of the last {k}")
    ax.set_xlabel("learner step")
    ax.set_ylabel("mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summary_line(stage: str, r: dict[str, Any]) -> str:
    bits = []
    if stage == "tests":
        bits.append(
            f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, {r.get('skipped', 0)} skipped"
        )
    for key in ("smollm2_full", "qwen3_1b_full", "smollm2_lora", "qwen3_1b_lora"):
        c = r.get(key)
        if isinstance(c, dict) and "tokens_per_s" in c:
            mfu = f", MFU {c['mfu']:.1%}" if c.get("mfu") is not None else ""
            bits.append(f"{key} {c['tokens_per_s']:.0f} tok/s{mfu}")
    for rows in (1, 16, 64, 256):
        c = r.get(f"batch_{rows}")
        if c:
            ratio = f" ({c['ratio']:.1f}x transformers)" if c.get("ratio") else ""
            bits.append(f"b{rows} {c['tokens_per_s']:.0f} tok/s{ratio}")
    if "install" in r:
        bits.append(f"install {r['install']['seconds_median'] * 1e3:.0f} ms")
    for key in ("smollm2", "qwen3_1b", "qwen3_3b", "tiny"):
        c = r.get(key)
        if isinstance(c, dict) and "pinned" in c:
            bits.append(
                f"{key} switch {c['pageable']['switch_s_median'] * 1e3:.0f} -> "
                f"{c['pinned']['switch_s_median'] * 1e3:.0f} ms"
            )
    if "ratio_median" in r:
        bits.append(f"relay/bare chain {r['ratio_median']:.3f} on {r.get('cpus')} CPUs")
    if "reward_first10" in r:
        bits.append(
            f"{len(r['curve'])} steps, reward {r['reward_first10']:.3f} -> {r['reward_last10']:.3f}"
        )
    ev = r.get("eval")
    if isinstance(ev, dict):
        (u, t), p = (x["reward"] for x in ev["policies"]), ev["paired"]
        bits.append(
            f"held-out {u['mean']:.3f} -> {t['mean']:.3f}, paired {p['mean']:+.3f} "
            f"[{p['lo']:+.3f}, {p['hi']:+.3f}]"
        )
    if r.get("skipped") and isinstance(r["skipped"], str):
        bits.append(r["skipped"])
    return "; ".join(bits)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / ".stages"
    tmp.mkdir(exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "dry_run": a.dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not a.dry_run:
        result["setup"] = install_wheels(a.wheels, a.site)
        carried = a.weights if a.weights is not None else sorted((ROOT / ".gpu").glob("part*"))
        result["weights"] = stash_weights(carried, a.stash)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(a.site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    sys.path[:0] = [str(a.site)]
    result["machine"] = machine()
    result["stages"] = {}
    path = a.out / "gpu_check.json"
    with open(a.out / "gpu_check.log", "a") as log:
        for stage in a.stages:
            result["stages"][stage] = run_stage(stage, a, env, tmp, log)
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    curve = result["stages"].get("learning", {}).get("curve", [])
    result["learning_curve_png"] = plot_curve(curve, a.out / "learning_curve.png")
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    metrics = tmp / "learning-run" / "metrics.jsonl"
    if metrics.is_file():  # every row of the run, beside the curve's few keys
        shutil.copy2(metrics, a.out / "learning_metrics.jsonl")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'stage':<11} {'outcome':<16} {'s':>6}  figures")
    for stage, r in result["stages"].items():
        print(f"{stage:<11} {r['outcome']:<16} {r['seconds']:>6.0f}  {summary_line(stage, r)}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
