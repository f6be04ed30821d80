"""How much of the learner's progress the workers' snapshots carry, by rounding scheme.

Issue 56: full fine-tuning samples from bf16 snapshots, and at lr 1e-5 most per-step updates
are below half a bf16 unit in the last place: a checkpoint that scored 0.910 on held-out scored
0.545 rounded to bf16 (docs/does-it-learn.md). SmolLM2's weights come from a bf16 GGUF, so
each starts exactly on the bf16 grid, and rounding to nearest (``nearest``, what the snapshot
cast does) sends a weight back to its start until its update passes half a unit.

This trains SmolLM2-135M-Instruct for ``--steps`` Adam steps at ``--lr`` on a fixed batch of
texts (float32 master weights, as the learner keeps them), publishing after every step under
each scheme, and measures on the batch's own loss what fraction of the master's improvement
over the start each scheme's last snapshot keeps (1.0: all of it), and how many weights each
publication changes (what a delta carries):

  * ``nearest``: ``w.to(bfloat16)``, the cast snapshots use today;
  * ``stochastic``: round up with probability equal to the fraction of a unit (unbiased;
    ``echo_rl.core.models.cast_weights``, what ``broadcast.rounding = "stochastic"`` publishes);
  * ``feedback``: error feedback, the learner keeping each weight's rounding error and adding
    it to the next publication's value before rounding (time-averaged exact);
  * ``float32``: the master itself (what ``broadcast.dtype = "float32"`` sends).

    .venv/bin/python benchmarks/snapshot_precision.py [--steps 8] [--lr 1e-5]

Writes ``benchmarks/results/snapshot_precision.json`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXTS = [
    "What is 7 + 5? Answer with only the number, like this: \\boxed{7} \\boxed{12}",
    "What is 3 + 9? Answer with only the number, like this: \\boxed{7} \\boxed{12}",
    "What is 8 + 6? Answer with only the number, like this: \\boxed{7} \\boxed{14}",
    "What is 4 + 4? Answer with only the number, like this: \\boxed{7} \\boxed{8}",
]
SCHEMES = ("nearest", "stochastic", "dither", "feedback", "float32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/smollm2-135m-instruct"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/snapshot_precision.json"))
    args = ap.parse_args(argv)
    if not Path(args.model).is_dir():
        print(f"no model folder at {args.model}: run `make smollm2` first", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo_rl.core.models import cast_weights

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    start = {n: p.detach().clone() for n, p in params}
    on_grid = sum(
        int((p.detach().to(torch.bfloat16).float() == p.detach()).sum()) for _, p in params
    ) / sum(p.numel() for _, p in params)

    def loss_with(weights: dict[str, Any] | None) -> float:
        saved = {}
        with torch.no_grad():
            if weights is not None:
                for n, p in params:
                    saved[n] = p.detach().clone()
                    p.copy_(weights[n].float())
            out = float(model(**batch, labels=labels).loss)
            for n, p in params:
                if n in saved:
                    p.copy_(saved[n])
        return out

    loss0 = loss_with(None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    residual = {n: torch.zeros_like(p) for n, p in params}
    last: dict[str, dict[str, Any]] = {s: {n: start[n].clone() for n, _ in params} for s in SCHEMES}
    changed: dict[str, list[float]] = {s: [] for s in SCHEMES}
    t0 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        model(**batch, labels=labels).loss.backward()
        opt.step()
        with torch.no_grad():
            for scheme in SCHEMES:
                moved = total = 0
                for j, (n, p) in enumerate(params):
                    w = p.detach()
                    if scheme == "nearest":
                        pub = w.to(torch.bfloat16)
                    elif scheme == "stochastic":  # what broadcast.rounding = "stochastic" sends
                        pub = cast_weights(w, "bfloat16", seed=step * 1_000_003 + j)
                    elif scheme == "dither":  # the same noise at every publication
                        pub = cast_weights(w, "bfloat16", seed=j)
                    elif scheme == "feedback":
                        target = w + residual[n]
                        pub = target.to(torch.bfloat16)
                        residual[n] = target - pub.float()
                    else:
                        pub = w.clone()
                    moved += int((pub.float() != last[scheme][n].float()).sum())
                    total += w.numel()
                    last[scheme][n] = pub
                changed[scheme].append(moved / total)
        print(f"step {step + 1}/{args.steps} ({time.perf_counter() - t0:.0f} s)", flush=True)
    master = loss_with({n: p.detach() for n, p in params})
    # What the publication path pays for it: the whole model cast to a bf16 payload
    # (echo_rl.core.models.params_to_payload, as echo_rl/learner/release.py calls it), each way, 3 times.
    from echo_rl.core.models import params_to_payload

    cast_s: dict[str, float] = {}
    for name, seed in (("nearest", None), ("stochastic", 1)):
        times = []
        for _ in range(3):
            t1 = time.perf_counter()
            params_to_payload(params, "bfloat16", seed)
            times.append(time.perf_counter() - t1)
        cast_s[name] = round(min(times), 3)
    print(
        f"payload cast (min of 3): nearest {cast_s['nearest']} s, stochastic {cast_s['stochastic']} s"
    )
    rows = []
    for scheme in SCHEMES:
        loss = loss_with(last[scheme])
        kept = (loss0 - loss) / (loss0 - master) if loss0 != master else float("nan")
        rows.append(
            {
                "scheme": scheme,
                "loss": round(loss, 5),
                "improvement_kept": round(kept, 3),
                "weights_changed_per_publication": round(
                    sum(changed[scheme]) / len(changed[scheme]), 4
                ),
                "bytes_per_weight": 4 if scheme == "float32" else 2,
            }
        )
    print(f"loss at the start {loss0:.4f}, the master after {args.steps} steps {master:.4f}")
    print(f"{'scheme':12} {'loss':>8} {'kept':>6} {'changed/publication':>20}")
    for r in rows:
        print(
            f"{r['scheme']:12} {r['loss']:8.4f} {r['improvement_kept']:6.3f} "
            f"{r['weights_changed_per_publication']:20.4f}"
        )
    out = {
        "command": "python benchmarks/snapshot_precision.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "load_avg": os.getloadavg(),
        },
        "model": Path(args.model).name,
        "steps": args.steps,
        "lr": args.lr,
        "weights_on_the_bf16_grid_at_start": round(on_grid, 4),
        "loss_start": round(loss0, 5),
        "loss_master": round(master, 5),
        "rows": rows,
        "payload_cast_s": cast_s,
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
