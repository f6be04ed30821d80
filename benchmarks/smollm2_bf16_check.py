"""The full fine-tuning run's latest checkpoint with its weights rounded to bfloat16 (what a worker
installs from a broadcast.dtype = "bfloat16" snapshot), scored like echo-rl eval --split heldout
--samples 4 --seed 0 (same prompts, same seeds). docs/does-it-learn.md, "Why the full run's training
curve stays flat".   python benchmarks/smollm2_bf16_check.py > benchmarks/results/smollm2_eval_full_bf16.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from echo_rl.cli.commands import evaluate as E
from echo_rl.core.ci import mean_ci
from echo_rl.data.adapter import load_adapter
from echo_rl.data.answers import check_answer_tokens

run = Path("runs/smollm2-full")
cfg = E.run_config(run)
backend = E.load_backend(cfg, 1)
print("backend dtype", next(backend.model.parameters()).dtype, file=sys.stderr, flush=True)
adapter = load_adapter(cfg.adapter.name, cfg.adapter.effective_options, backend.tokenizer)
backend.restrict_answers(
    check_answer_tokens(
        adapter.answer_tokens, backend.vocab_size, 16, backend.tokenizer.eos_token_id
    )
)
prompts, used = E.eval_prompts(adapter, "heldout", 100, 0, "math")
pol = E.resolve_policy(run, "latest")
import dataclasses

pol = dataclasses.replace(
    pol,
    state={
        k: (v.to(torch.bfloat16).to(v.dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
        for k, v in pol.state.items()
    },
)
E.install_policy(backend, pol, {})
r = E.score(backend, adapter, prompts, 4, 16, 0.7, 0)
print(
    json.dumps(
        {"policy": pol.label + " rounded to bf16", "reward": mean_ci(r).as_dict(), "per_prompt": r}
    ),
    flush=True,
)
adapter.close()
