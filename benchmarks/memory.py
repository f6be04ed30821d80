"""Memory per parameter of a learner and its workers (issue 41, docs/memory.md).

    .venv/bin/python benchmarks/memory.py --model tiny models/smollm2-135m-instruct random-0.4b \
        [--steps 4] [--workers 2] [--no-spill]     # writes benchmarks/results/memory.json

For each model: a learner (full fine-tuning, audits on) and ``--workers`` workers on loopback,
``--steps`` learner steps. Every 0.5 s the benchmark reads each process's resident set from
/proc (VmRSS, its anonymous and file-backed parts); at the end it reads the peak (VmHWM) and
the processes' own census of what holds memory (the learner's metrics rows and the workers'
status files, ``memory``; echo_rl.core.memstat): model, gradients, optimizer, audit model, and
snapshot payloads in RAM or spilled to files (echo_rl.core.spill). ``random-0.4b`` is SmolLM2's
architecture widened to about 0.42 B parameters (hidden 1280, 20 layers, MLP 3584), random
weights, written once under ~/.cache/echo/models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from echo_rl.worker.status import read_status  # noqa: E402

GIB = 1 << 30


def random_model(name: str) -> Path:
    """A random-init Llama folder (SmolLM2's tokenizer), written once."""
    folder = Path(os.environ.get("ECHO_HOME", Path.home() / ".cache" / "echo")) / "models" / name
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = ROOT / "models" / "smollm2-135m-instruct"
    cfg = LlamaConfig.from_pretrained(src)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = 1280, 20, 3584
    cfg.num_attention_heads, cfg.num_key_value_heads = 20, 4
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def config_for(model: str, steps: int, spill: bool, tmp: Path, overrides: list[str]) -> Path:
    from echo_rl.core.config import dump_toml, load_config

    real = model != "tiny"
    base = ROOT / ("examples/smollm2-math.toml" if real else "examples/quickstart.toml")
    name = str(random_model(model)) if model.startswith("random-") else model
    sets = [
        f"learner.max_steps={steps}",
        "learner.prompts_per_step=2",
        "learner.group_size=4",
        "worker.max_new_tokens=16",
        "provisioning.enabled=false",
        "security.audit=true",
        f"learner.spill_payloads={str(spill).lower()}",
        "learner.checkpoint=false",
        "metrics.enabled=false",
    ]
    if real:
        sets += [f"model.name={name}"]
    cfg = load_config(base, sets + overrides)
    path = tmp / f"{Path(model).name}.toml"
    path.write_text(dump_toml(cfg))
    return path


class Sampler:
    """Peak resident figures of a set of processes, read from /proc every ``period`` s."""

    FIELDS = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "rss_peak"}

    def __init__(self) -> None:
        self.peak: dict[str, dict[str, int]] = {}
        self.at_peak: dict[str, dict[str, int]] = {}  # the sample with the largest VmRSS
        self.timeline: dict[str, list[list[float]]] = {}  # [t, rss, anon, file] in GiB
        self.t0 = time.monotonic()

    def sample(self, procs: dict[str, Any]) -> None:
        t = round(time.monotonic() - self.t0, 1)
        for name, proc in procs.items():
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue  # it ended
            got = {
                self.FIELDS[k]: int(v.split()[0]) * 1024
                for k, _, v in (line.partition(":") for line in text.splitlines())
                if k in self.FIELDS
            }
            mine = self.peak.setdefault(name, {})
            if got.get("rss", 0) > mine.get("rss", 0):
                self.at_peak[name] = {**got, "t": t}
            for k, v in got.items():
                mine[k] = max(mine.get(k, 0), v)
            self.timeline.setdefault(name, []).append(
                [t, *(round(got.get(k, 0) / GIB, 3) for k in ("rss", "rss_anon", "rss_file"))]
            )


def run_case(
    model: str, steps: int, workers: int, spill: bool, tmp: Path, overrides: list[str]
) -> dict[str, Any]:
    from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready

    conf = config_for(model, steps, spill, tmp, overrides)
    tag = f"{Path(model).name}-{'spill' if spill else 'ram'}"
    run, status = tmp / f"run-{tag}", tmp / f"status-{tag}"
    status.mkdir()
    group, sampler = ProcessGroup(), Sampler()
    t0 = time.monotonic()
    try:
        learner = group.start(
            "learner",
            python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
            tmp / f"learner-{tag}.err",
            pipe_stdout=True,
            cwd=ROOT,
        )
        line = wait_ready(learner, timeout=900)
        for i in range(workers):
            group.start(
                f"w{i}",
                python_argv(
                    "echo_rl.cli.worker",
                    "join",
                    line,
                    "--id",
                    f"w{i}",
                    "--plain",
                    "--identity",
                    str(tmp / f"w{i}-{tag}.key"),
                ),
                tmp / f"w{i}-{tag}.log",
                env={"ECHO_STATUS_DIR": str(status)},
                cwd=ROOT,
            )
        shown = -1
        while learner.poll() is None and time.monotonic() - t0 < 3600:
            sampler.sample(group.procs)
            shown = progress(run, steps, t0, shown)
            time.sleep(0.5)
    finally:
        group.stop_all(timeout=30)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    census = (
        {
            k: max(r["memory"].get(k, 0) for r in rows if "memory" in r)
            for k in rows[-1].get("memory", {})
        }
        if rows
        else {}
    )
    worker_census = [read_status(p).memory or {} for p in sorted(status.glob("*.json"))]
    return {
        "model": model,
        "spill": spill,
        "steps": len(rows),
        "params": census.get("model", 0) // 4,
        "wall_s": round(time.monotonic() - t0, 1),
        "peak": sampler.peak,
        "at_peak": sampler.at_peak,
        "timeline": sampler.timeline,
        "overrides": overrides,
        "learner_census": census,
        "worker_census": worker_census,
    }


def progress(run: Path, steps: int, t0: float, shown: int) -> int:
    """Says each finished step once (a step of a 0.4 B model takes a minute here)."""
    path = run / "metrics.jsonl"
    done = sum(1 for _ in path.open()) if path.exists() else 0
    if done != shown:
        print(f"  {done}/{steps} steps, {time.monotonic() - t0:.0f} s", flush=True)
    return done


def per_param(case: dict[str, Any]) -> dict[str, Any]:
    """Bytes per parameter, and the issue's bounds: a worker at most model (in its dtype) +
    one payload + 1 GiB; the learner at most its training state + one payload + 2 GiB."""
    n = max(case["params"], 1)
    lc, payload = case["learner_census"], 2 * n  # one bf16 payload
    learner = case["peak"].get("learner", {})
    workers = [v for k, v in case["peak"].items() if k != "learner"]
    worker_peak = max((w.get("rss_peak", 0) for w in workers), default=0)
    worker_anon = max((w.get("rss_anon", 0) for w in workers), default=0)
    # the worker's model as its census counted it (float32 on a CPU: 4 bytes a parameter)
    wmodel = max((w.get("model", 0) for w in case["worker_census"]), default=0) or 4 * n
    train = lc.get("model", 0) + lc.get("grads", 0) + lc.get("optimizer", 0)
    return {
        "learner_peak_per_param": round(learner.get("rss_peak", 0) / n, 2),
        "learner_anon_per_param": round(learner.get("rss_anon", 0) / n, 2),
        "worker_peak_per_param": round(worker_peak / n, 2),
        "worker_anon_per_param": round(worker_anon / n, 2),
        "learner_bound_bytes": train + payload + 2 * GIB,
        "learner_within_bound": learner.get("rss_peak", 0) <= train + payload + 2 * GIB,
        "worker_bound_bytes": wmodel + payload + GIB,
        "worker_within_bound": worker_peak <= wmodel + payload + GIB,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--no-spill",
        action="store_true",
        help="also run each model with learner.spill_payloads = false (the versions held in RAM)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every case (e.g. learner.gradient_checkpointing=true)",
    )
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/memory.json")
    ap.add_argument(
        "--lora-json",
        type=Path,
        default=ROOT / "benchmarks/results/memory_lora.json",
        help="a LoRA run's results (--set learner.lora.enabled=true): the machine "
        "table's LoRA column; absent: that column is derived",
    )
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="measure nothing: the table and machine sizes again from --json",
    )
    args = ap.parse_args(argv)
    if args.recompute:
        doc = json.loads(args.json.read_text())
        doc["machines"] = machines(doc["cases"], _lora_case(args.lora_json))
        args.json.write_text(json.dumps(doc, indent=2))
        _report(doc["cases"], doc["machines"])
        return 0
    from echo_rl.core.machine import write_result

    cases = []
    with tempfile.TemporaryDirectory(prefix="echo-mem-") as tmp:
        for model in args.model:
            for spill in (True, False) if args.no_spill else (True,):
                print(f"{model}, spill {'on' if spill else 'off'}:", flush=True)
                case = run_case(model, args.steps, args.workers, spill, Path(tmp), args.set)
                case.update(per_param(case))
                cases.append(case)
                print(
                    json.dumps({k: v for k, v in case.items() if k not in ("peak", "timeline")}),
                    flush=True,
                )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    fit = machines(cases, _lora_case(args.lora_json))
    _plot(cases, args.json.with_suffix(".png"))
    timelines = {
        f"{Path(c['model']).name}-{'spill' if c['spill'] else 'ram'}": c.pop("timeline")
        for c in cases
    }  # one line: thousands of samples
    write_result(args.json, {"argv": sys.argv[1:], "cases": cases, "machines": fit})
    args.json.with_name(args.json.stem + "_timeline.json").write_text(json.dumps(timelines))
    _report(cases, fit)
    return 0


def _lora_case(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    cases = json.loads(path.read_text())["cases"]
    return max(cases, key=lambda c: c["params"]) if cases else None


def _report(cases: list[dict[str, Any]], fit: dict[str, Any]) -> None:
    _table(cases)
    for name, row in fit.get("sizes", {}).items():
        print(
            f"{name:>5}: learner {row['learner_full_gib']} GiB (LoRA {row['learner_lora_gib']}), "
            f"worker {row['worker_cpu_gib']} GiB host memory on a CPU"
        )


SIZES = {"0.5B": 0.5e9, "1.5B": 1.5e9, "7B": 7e9, "8B": 8e9}


def machines(cases: list[dict[str, Any]], lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """Host memory for a learner and a worker at each of SIZES, from the measured cases with
    spilling on: a fixed part (the smallest model's peak: Python, torch, transformers) plus
    bytes per parameter from the largest (its peak above that fixed part, per parameter).
    The LoRA learner column comes from ``lora`` (a LoRA run's case, ``--lora-json``) the same
    way; without one it is derived: the frozen float32 model and the fixed part only."""
    spilled = [c for c in cases if c["spill"] and c["params"]]
    if len(spilled) < 2:
        return {}
    small, big = min(spilled, key=lambda c: c["params"]), max(spilled, key=lambda c: c["params"])

    def peak(c: dict[str, Any], role: str) -> int:
        return max(
            (
                v.get("rss_peak", 0)
                for k, v in c["peak"].items()
                if (k == "learner") == (role == "learner")
            ),
            default=0,
        )

    lf, wf = peak(small, "learner"), peak(small, "worker")
    lb, wb = (peak(big, "learner") - lf) / big["params"], (peak(big, "worker") - wf) / big["params"]
    if lora is not None:
        lora_b, lora_from = (peak(lora, "learner") - lf) / lora["params"], "measured"
    else:
        lora_b, lora_from = big["learner_census"].get("model", 0) / big["params"], "derived"
    rows = {
        name: {
            "learner_full_gib": round((lf + lb * p) / GIB, 1),
            "learner_lora_gib": round((lf + lora_b * p) / GIB, 1),
            "worker_cpu_gib": round((wf + wb * p) / GIB, 1),
            "worker_disk_gib": round(2 * 2 * p / GIB, 1),
        }  # base model + a spilled version
        for name, p in SIZES.items()
    }
    return {
        "fit": {
            "learner_fixed_bytes": lf,
            "learner_bytes_per_param": round(lb, 2),
            "worker_fixed_bytes": wf,
            "worker_bytes_per_param": round(wb, 2),
            "lora_learner_bytes_per_param": round(lora_b, 2),
            "lora_from": lora_from,
            "from": [Path(small["model"]).name, Path(big["model"]).name],
        },
        "sizes": rows,
    }


def _table(cases: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="peak resident memory per parameter (bytes), learner and workers")
    for col in (
        "model",
        "params",
        "spill",
        "learner peak",
        "learner anon",
        "training state",
        "audit model",
        "payloads RAM / spilled",
        "worker peak",
        "worker anon",
        "learner within bound",
        "worker within bound",
    ):
        t.add_column(col, justify="right")
    for c in cases:
        n, lc = max(c["params"], 1), c["learner_census"]
        train = lc.get("model", 0) + lc.get("grads", 0) + lc.get("optimizer", 0)
        t.add_row(
            Path(c["model"]).name,
            f"{c['params'] / 1e6:.1f} M",
            "on" if c["spill"] else "off",
            f"{c['learner_peak_per_param']:.1f}",
            f"{c['learner_anon_per_param']:.1f}",
            f"{train / n:.1f}",
            f"{lc.get('audit_model', 0) / n:.1f}",
            f"{lc.get('payloads_ram', 0) / n:.1f} / {lc.get('payloads_spilled', 0) / n:.1f}",
            f"{c['worker_peak_per_param']:.1f}",
            f"{c['worker_anon_per_param']:.1f}",
            str(c["learner_within_bound"]),
            str(c["worker_within_bound"]),
        )
    Console(width=200).print(t)


def _plot(cases: list[dict[str, Any]], path: Path) -> None:
    """Resident memory over time, anonymous and file-backed, one panel per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 3 * len(cases)), squeeze=False)
    for ax, c in zip(axes[:, 0], cases):
        for name, series in c.get("timeline", {}).items():
            t = [r[0] for r in series]
            (line,) = ax.plot(t, [r[1] for r in series], label=f"{name} resident")
            ax.plot(
                t,
                [r[2] for r in series],
                ls="--",
                color=line.get_color(),
                label=f"{name} anonymous",
            )
        bound = c.get("learner_bound_bytes", 0) / GIB
        ax.axhline(bound, color="grey", ls=":", label="learner bound")
        ax.axhline(
            c.get("worker_bound_bytes", 0) / GIB, color="grey", ls="-.", label="worker bound"
        )
        ax.set_title(
            f"{Path(c['model']).name}, spill {'on' if c['spill'] else 'off'} "
            f"{' '.join(c.get('overrides', []))}",
            fontsize=9,
        )
        ax.set_xlabel("s")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
