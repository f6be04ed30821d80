"""How far a bfloat16 CPU worker's log-probs lie from the learner's float32 recomputation
(docs/memory.md): the margin a worker that halves its model to fit ``--host-memory-gb`` keeps
under ``security.audit_logprob_tol``.

    .venv/bin/python benchmarks/bf16_logprobs.py [--model models/smollm2-135m-instruct]
        # writes benchmarks/results/bf16_logprobs.json

A transformers worker in bfloat16 samples 4 completions of 48 tokens for each of a few chat
prompts; the same model in float32 recomputes each completion's token log-probs (as the
auditor does); the figure is the mean |claimed - recomputed| per token of each sample.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Write a haiku about rain.",
    "Name three prime numbers.",
    "Explain in one sentence why the sky is blue.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/bf16_logprobs.json")
    args = ap.parse_args(argv)
    import torch

    from echo_rl.core import wire
    from echo_rl.core.config import ModelConfig, SecurityConfig
    from echo_rl.core.machine import write_result
    from echo_rl.learner.trainer import token_logprobs
    from echo_rl.worker.backends import make_backend

    cfg = ModelConfig(name=args.model)
    f32 = make_backend("transformers", model_cfg=cfg, threads=2, dtype="float32")
    bf16 = make_backend("transformers", model_cfg=cfg, threads=2, dtype="bfloat16")
    tok = bf16.tokenizer
    diffs = []
    for i, text in enumerate(PROMPTS):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = list(tok(chat, add_special_tokens=False)["input_ids"])
        [samples] = bf16.generate(
            [wire.Group(group_id=f"g{i}", prompt_ids=ids, n=4, seed=i)],
            max_new_tokens=48,
            temperature=1.0,
        )
        for s in samples:
            full = torch.tensor([ids + list(s.completion_ids)])
            with torch.no_grad():
                recomputed = token_logprobs(f32.model, full, torch.ones_like(full))[
                    0, len(ids) - 1 :
                ]
            claimed = torch.tensor(s.logprobs)
            diffs.append(float((recomputed[: len(claimed)] - claimed).abs().mean()))
    tol = SecurityConfig().audit_logprob_tol
    out = {
        "model": args.model,
        "samples": len(diffs),
        "mean_abs_dlogp": diffs,
        "mean": sum(diffs) / len(diffs),
        "max": max(diffs),
        "audit_logprob_tol": tol,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, {"argv": sys.argv[1:], **out})
    print(
        f"{len(diffs)} samples: mean |claimed - recomputed| per token {out['mean']:.3f} nats "
        f"(max {out['max']:.3f}); security.audit_logprob_tol = {tol}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
