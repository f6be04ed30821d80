"""How long a learner step waits for its publication: before (full snapshots built on the
training thread) and after (deltas built on the publisher thread), with real weights; and
deltas built on the training thread, to tell what the thread itself buys on this machine.

Each mode runs the same real training steps of SmolLM2-135M-Instruct on this CPU (Adam at
``--lr`` on a fixed SFT batch, float32 weights, bf16 snapshots), and after each step hands the
version to the learner's own ``echo_rl.learner.publisher.Publisher`` exactly as ``echo_rl/learner/main.py``
does (``params_to_payload`` then ``submit``). Per step it records ``t_train`` (forward,
backward, optimizer) and ``t_publish`` (what the training thread spent on the publication:
the payload copy plus building it inline, or plus waiting for the hand-over slot). The
publication goes to a sink that keeps its size (the control plane's part, a store insert and a
notice per worker, is the same in both modes). The modes run one after the other, each on its
own copy of the model, so that a publisher thread only ever overlaps its own mode's next step
(on two cores it competes with that step for the CPU, and ``t_train`` shows it).

    .venv/bin/python benchmarks/bench_publish.py [--steps 6] [--lr 1e-6] [--json FILE]

Writes ``benchmarks/results/publish.json`` with the machine and its load averages.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from echo_rl.core.steprow import COL  # noqa: E402

MODES = {
    "before": {"delta": False, "background": False},  # full, on the training thread
    "delta-inline": {"delta": True, "background": False},  # deltas, on the training thread
    "after": {"delta": True, "background": True},  # deltas, on the publisher thread
    # As the learner runs with learner.checkpoint (the default): a checkpoint (model and Adam
    # state, fsynced) before every publication, on the training thread, the publication built
    # on the publisher thread (the CPU learner before issue 50's publication change) ...
    "checkpoint-inline": {"delta": True, "background": True, "checkpoint": True},
    # ... the same with the publication built on the training thread too (release_thread off:
    # the CPU learner since) ...
    "all-inline": {"delta": True, "background": False, "checkpoint": True},
    # ... or frozen in host copies and released on the release thread (issue 50, the default)
    "release-thread": {"delta": True, "background": True, "checkpoint": True, "thread": True},
}
TEXTS = [
    "The learner publishes a new version of the policy after every step.",
    "Workers on home connections relay each chunk to the next worker in the chain.",
    "A delta carries only the weights whose bf16 value changed since the last version.",
    "Every rebuilt payload is checked against the hashes the learner signed.",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeat", type=int, default=1, help="the batch's texts this many times (a longer step)"
    )
    ap.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="which modes to run"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "publish.json")
    return ap.parse_args(argv)


class Arm:
    """One mode: its own model copy, optimizer and publisher."""

    def __init__(self, name: str, model: Any, lr: float, batch: Any, ckpt_dir: Path):
        import torch

        from echo_rl.broadcast.snapshot import RunKey
        from echo_rl.broadcast.versions import VersionEncoder
        from echo_rl.learner.publisher import Publisher

        self.name, self.model, self.batch = name, model, batch
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.sent: list[tuple[str, int, int]] = []
        enc = VersionEncoder(
            run_id="bench",
            key=RunKey.generate(),
            chunk_size=1 << 20,
            dtype="bfloat16",
            delta=MODES[name]["delta"],
            keyframe_every=1000,
        )
        self.publisher = Publisher(
            enc,
            lambda snap: self.sent.append(
                (snap.manifest.encoding, len(snap.payload), len(snap.full))
            ),
            threaded=MODES[name]["background"],
        )
        self.rows: list[dict[str, float]] = []
        self.checkpoints = ckpt_dir / name if MODES[name].get("checkpoint") else None
        self.releaser = None
        if MODES[name].get("thread"):
            from echo_rl.learner.releasing import ReleaseThread

            self.releaser = ReleaseThread(lambda v: True, self._save, self._send)

    def _save(self, v: Any) -> None:
        from echo_rl.learner.checkpoint import save_checkpoint

        assert self.checkpoints is not None
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        save_checkpoint(self.checkpoints, v.steps - 1, {"model": v.model, "optimizer": v.optimizer})

    def _send(self, v: Any) -> None:
        from echo_rl.core.models import params_to_payload

        names = [n for n, _ in self.model.named_parameters()]
        tensors, payload = params_to_payload(((n, v.model[n]) for n in names), "bfloat16")
        self.publisher.submit(v.steps, tensors, payload)

    def publish(self, version: int) -> float:
        """What the training thread spends on a publication (``t_publish``)."""
        from echo_rl.learner.releasing import Version

        t0 = time.perf_counter()
        model_sd, opt_sd = self.model.state_dict(), self.opt.state_dict()
        v = Version(version, model_sd, opt_sd, checkpoint=self.checkpoints is not None)
        if self.releaser is not None:
            frozen = self.releaser.freeze(model_sd, opt_sd)
            self.releaser.submit(Version(version, *frozen, checkpoint=True))
        else:
            if self.checkpoints is not None:
                self._save(v)
            self._send(v)
        return time.perf_counter() - t0

    def finish(self) -> None:
        if self.releaser is not None:
            self.releaser.flush()
            self.releaser.close()
        self.publisher.flush()
        self.publisher.close()

    def step(self, version: int) -> None:
        t0 = time.perf_counter()
        out = self.model(input_ids=self.batch, labels=self.batch)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t_train = time.perf_counter() - t0
        row = {"version": version, COL.t_train: t_train, COL.t_publish: self.publish(version)}
        if self.releaser is not None:  # the previous version's time on the release thread
            row["release_s"] = self.releaser.last_s
        self.rows.append(row)


def summary(arm: Arm) -> dict[str, Any]:
    rows = arm.rows[1:]  # the first publication is a keyframe in both modes
    pub = [r[COL.t_publish] for r in rows]
    step = [r[COL.t_train] + r[COL.t_publish] for r in rows]
    sizes = arm.sent[1:]
    return {
        "t_publish_median": statistics.median(pub),
        "t_publish_max": max(pub),
        "t_train_median": statistics.median(r[COL.t_train] for r in rows),
        "step_median": statistics.median(step),
        "bytes_median": statistics.median(b for _, b, _ in sizes),
        "full_bytes": sizes[0][2],
        "encodings": sorted({e for e, _, _ in sizes}),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from echo_rl.core.config import ModelConfig
    from echo_rl.core.machine import write_result
    from echo_rl.core.models import ModelError, load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(name=args.model)
    try:
        tok = load_tokenizer(cfg)
        base = load_model(cfg, tok, "float32")
    except ModelError as err:
        raise SystemExit(
            f"{err}\nfix: `make smollm2` (echo-rl model smollm2) builds {args.model}"
        ) from None
    batch = tok(TEXTS * args.repeat, return_tensors="pt", padding=True).input_ids
    load_before = os.getloadavg()
    ckpt_dir = Path(tempfile.mkdtemp(prefix="echo-bench-publish-"))
    arms = [Arm(name, copy.deepcopy(base), args.lr, batch, ckpt_dir) for name in args.modes]
    with Progress() as progress:
        for arm in arms:
            task = progress.add_task(f"{arm.name}: steps", total=args.steps)
            arm.publish(0)  # version 0: the pretrained weights, a keyframe
            for version in range(1, args.steps + 1):
                arm.step(version)
                progress.advance(task)
            arm.finish()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    result = {
        "command": " ".join(sys.argv),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "model": args.model,
        "lr": args.lr,
        "steps": args.steps,
        "modes": {a.name: {"summary": summary(a), "rows": a.rows} for a in arms},
    }
    s = {a.name: result["modes"][a.name]["summary"] for a in arms}
    for new, old in (("after", "before"), ("release-thread", "checkpoint-inline")):
        if new in s and old in s:
            key = f"{new}_over_{old}".replace("-", "_")
            result[f"t_publish_{key}"] = s[new]["t_publish_median"] / s[old]["t_publish_median"]
            result[f"step_{key}"] = s[new]["step_median"] / s[old]["step_median"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, result)
    table = Table(
        title=f"learner step vs publication, {args.model}, lr {args.lr} (median over "
        f"steps 2..{args.steps})"
    )
    for col in ("mode", "t_train s", "t_publish s", "step s", "bytes / publication", "encodings"):
        table.add_column(col)
    for name, v in s.items():
        table.add_row(
            name,
            f"{v['t_train_median']:.2f}",
            f"{v['t_publish_median']:.3f}",
            f"{v['step_median']:.2f}",
            f"{v['bytes_median'] / 2**20:.1f} MiB of {v['full_bytes'] / 2**20:.0f}",
            ",".join(v["encodings"]),
        )
    Console().print(table)
    ratios = "; ".join(
        f"{k}: {v:.3f}" for k, v in result.items() if k.startswith(("t_publish_", "step_"))
    )
    print(f"{ratios}; load {load_before[0]:.1f} -> {result['loadavg_after'][0]:.1f}; {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
