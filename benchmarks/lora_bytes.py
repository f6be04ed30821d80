"""Bytes per version with LoRA against full fine-tuning, for SmolLM2-135M-Instruct (issue 32).

For each mode (the whole model; LoRA at the default rank 16 on every linear layer; LoRA rank 8 on
q_proj and v_proj) the model is built as the learner builds it (``echo_rl.learner.policy.Policy``: peft
wraps the base when ``[learner.lora]`` is on), then takes ``--steps`` real learner steps
(``Trainer.step``, GRPO on a fixed batch of random completions with +-1 advantages), and after
each the version is published as the learner publishes it: ``params_to_payload`` in bf16, then
the learner's ``VersionEncoder`` (a keyframe first, deltas after; a delta bigger than 80 % of
the version is sent whole, ``broadcast.delta_max_ratio``). Per mode: the trained parameters,
the bytes of a keyframe (what a joiner needs) and of each published version, and both as a
share of the full model's keyframe.

    .venv/bin/python benchmarks/lora_bytes.py [--model models/smollm2-135m-instruct] [--steps 3]

Results: ``benchmarks/results/lora_bytes.json`` (with the machine). The target of issue 32:
a LoRA version at most 5 % of the full model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {  # name -> [learner] settings
    "full": {"lr": 1e-6},
    "lora-r16-all-linear": {"lr": 1e-4, "lora": {"enabled": True}},
    "lora-r8-q-v": {
        "lr": 1e-4,
        "lora": {"enabled": True, "rank": 8, "target_modules": ["q_proj", "v_proj"]},
    },
}


def config(model: str, learner: dict[str, Any]) -> Any:
    from echo_rl.core.config import EchoConfig

    return EchoConfig.model_validate(
        {
            "model": {"name": model},
            "learner": {"device": "cpu", "prompts_per_step": 2, "group_size": 2, **learner},
            "broadcast": {"dtype": "bfloat16"},
        }
    )


def batch(tokenizer: Any, seed: int = 0) -> Any:
    """Two groups of two random completions (24 tokens) after 16-token prompts, advantages +-1."""
    import torch

    from echo_rl.data.adapter import materialise_records
    from echo_rl.data.records import Record

    g = torch.Generator().manual_seed(seed)
    vocab, first = len(tokenizer), min(100, len(tokenizer) // 2)  # past the special tokens

    def ids(n: int) -> list[int]:
        return torch.randint(first, vocab, (n,), generator=g).tolist()

    groups = [
        [
            Record(
                group_id=f"g{k}",
                sample_idx=i,
                prompt_ids=ids(16),
                completion_ids=ids(24),
                logprobs=[-8.0] * 24,
                reward=float(i),
                version=0,
                worker_id="w",
            )
            for i in range(2)
        ]
        for k in range(2)
    ]
    return materialise_records(groups, [1.0, -1.0, 1.0, -1.0], tokenizer.pad_token_id)


def measure(model: str, name: str, learner: dict[str, Any], steps: int) -> dict[str, Any]:
    from echo_rl.broadcast.snapshot import RunKey
    from echo_rl.broadcast.versions import VersionEncoder
    from echo_rl.core.models import params_to_payload
    from echo_rl.learner.policy import Policy, Step, Sync

    cfg = config(model, learner)
    policy = Policy(cfg)
    enc = VersionEncoder(
        run_id="bench",
        key=RunKey.generate(),
        chunk_size=cfg.broadcast.chunk_bytes,
        dtype="bfloat16",
        base_model=policy.base_hash,
        max_ratio=cfg.broadcast.delta_max_ratio,
    )
    versions, t_step = [], []
    data = batch(policy.tokenizer)
    for v in range(steps + 1):
        if v:
            t0 = time.perf_counter()
            policy.command(Step(data))
            t_step.append(round(time.perf_counter() - t0, 3))
        _, full = policy.command(Sync())
        tensors, payload = params_to_payload(policy.named_tensors(full[0]), "bfloat16")
        pub = enc.build(v, tensors, payload)
        versions.append(
            {
                "version": v,
                "encoding": pub.manifest.encoding,
                "bytes": len(pub.payload),
                "version_bytes": len(payload),
            }
        )
    trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.model.parameters())
    print(
        f"{name}: {trained:,} of {total:,} parameters trained; keyframe {versions[0]['bytes']:,} "
        f"bytes; versions {[x['bytes'] for x in versions[1:]]} ({[x['encoding'] for x in versions[1:]]})",
        flush=True,
    )
    return {
        "mode": name,
        "learner": learner,
        "trained_params": trained,
        "total_params": total,
        "keyframe_bytes": versions[0]["bytes"],
        "versions": versions,
        "t_step_s": t_step,
        "base_hash": policy.base_hash,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_bytes.json")
    args = p.parse_args(argv)
    import torch

    from echo_rl.core.machine import write_result

    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model folder; `make smollm2` builds it")
    torch.set_num_threads(args.threads)
    rows = [measure(args.model, name, learner, args.steps) for name, learner in MODES.items()]
    full = rows[0]["keyframe_bytes"]
    for r in rows:
        r["keyframe_share_of_full"] = round(r["keyframe_bytes"] / full, 5)
        r["mean_version_share_of_full"] = round(
            sum(v["bytes"] for v in r["versions"][1:]) / max(1, len(r["versions"]) - 1) / full, 5
        )
        print(
            f"{r['mode']}: keyframe {100 * r['keyframe_share_of_full']:.2f} % of full, "
            f"a published version {100 * r['mean_version_share_of_full']:.2f} % on average"
        )
    doc = {
        "model": args.model,
        "steps": args.steps,
        "dtype": "bfloat16",
        "rows": rows,
        "target": "LoRA version <= 5 % of the full model (issue 32)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
