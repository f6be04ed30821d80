"""Learner throughput: our ``Trainer.step`` vs TRL's GRPO training step, same model, same batch.

One *learner step* on a batch of B sequences (prompt P + completion C tokens) is, on both sides:

  1. a no-grad forward over the whole batch for the step-start log-probs (ours: ``old``; TRL: the
     ``old_per_token_logps`` it computes in ``_generate_and_score_completions`` whenever
     ``steps_per_generation > 1``), plus the truncated IS weight;
  2. ``updates`` optimizer updates, each on a shuffled 1/updates slice of the batch: forward,
     GRPO loss, backward, grad-norm clip at 1.0, optimizer step.

Ours: ``echo_rl.learner.trainer.Trainer.step(LearnerBatch)``.
TRL:  ``GRPOTrainer`` (trl, token-level loss ``loss_type="bnpo"`` == our ``token-mean``), with its
      own ``_get_per_token_logps_and_entropies`` for step 1, its ``shuffle_sequence_dict`` /
      ``split_tensor_dict`` for the slices, and for each slice the Hugging Face
      ``Trainer.training_step`` (compute_loss + accelerator.backward) followed by what the HF
      loop does at an optimizer boundary (``accelerator.clip_grad_norm_``, ``optimizer.step``,
      ``model.zero_grad``). Generation and reward scoring are not timed (nor run).
      Both sides use ``torch.optim.Adam`` with the same lr unless ``--trl-optimizer hf``
      (TRL/HF's default optimizer, AdamW fused).

Tokens per step = real (attention-masked) prompt + completion tokens of the batch; trained
tokens = completion tokens. Both sides get the same ``torch.set_num_threads``, interleaved
repetitions after a warm-up, medians reported; ``ratio`` = ours / TRL tokens/s.

    cd /work/main && .venv/bin/python benchmarks/bench_learner.py [--preset small] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _k, _v in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("WANDB_DISABLED", "true"),
    ("WANDB_MODE", "disabled"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_k, _v)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere, installed or not
    sys.path.insert(0, str(ROOT))

PRESETS = {
    # ModelConfig defaults (echo_rl/core/config.py): the tiny model the quickstart and tests use
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--hidden", type=int, help="override hidden_size")
    p.add_argument("--layers", type=int, help="override num_layers")
    p.add_argument("--intermediate", type=int, help="override intermediate_size")
    p.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="model vocabulary (default: the tiny tokenizer's 24 tokens); a larger one makes the "
        "LM head / log-softmax cost realistic, token ids are then drawn from all of it",
    )
    p.add_argument("--batch", type=int, default=64, help="sequences per learner step")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=24)
    p.add_argument(
        "--ragged",
        action="store_true",
        help="completion lengths uniform in [C/2, C] (default: every completion has C tokens)",
    )
    p.add_argument("--updates", type=int, default=2, help="optimizer updates per learner step")
    p.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient (> 0 adds a reference model)"
    )
    p.add_argument(
        "--fused-head",
        choices=["on", "off"],
        default="on",
        help="learner.fused_head of our side (on: the default)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--trl-optimizer",
        choices=["adam", "hf"],
        default="adam",
        help="adam: torch.optim.Adam like ours; hf: the optimizer GRPOTrainer builds by default",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "learner.json"))
    a = p.parse_args(argv)
    if a.batch % a.updates:
        p.error(f"--batch {a.batch} must be divisible by --updates {a.updates}")
    return a


def model_config(a: argparse.Namespace) -> Any:
    from echo_rl.core.config import ModelConfig

    kw = dict(PRESETS[a.preset])
    if a.hidden:
        kw["hidden_size"] = a.hidden
        kw["head_dim"] = a.hidden // kw["num_heads"]
    if a.layers:
        kw["num_layers"] = a.layers
    if a.intermediate:
        kw["intermediate_size"] = a.intermediate
    return ModelConfig(max_positions=max(64, a.prompt_len + a.completion_len), seed=a.seed, **kw)


def build_model(a: argparse.Namespace, mcfg: Any, tok: Any) -> Any:
    """``echo_rl.core.models.load_model`` (tiny Qwen3, seeded random init), or the same with a bigger vocab."""
    from echo_rl.core.models import load_model, tiny_config

    if not a.vocab or a.vocab == len(tok):
        return load_model(mcfg, tok)
    import torch
    from transformers import Qwen3ForCausalLM

    if a.vocab < len(tok):
        raise SystemExit(f"--vocab {a.vocab} is smaller than the tokenizer ({len(tok)} tokens)")
    cfg = tiny_config(mcfg, tok)
    cfg.vocab_size = a.vocab
    torch.manual_seed(mcfg.seed)
    return Qwen3ForCausalLM(cfg)


def make_batch(a: argparse.Namespace, model: Any, tok: Any) -> tuple[Any, dict[str, Any]]:
    """One batch in both layouts: our LearnerBatch and TRL's prompt/completion dict."""
    import torch

    from echo_rl.data.adapter import LearnerBatch
    from echo_rl.data.advantages import group_advantages
    from echo_rl.learner.trainer import token_logprobs

    g = torch.Generator().manual_seed(a.seed)
    B, P, C = a.batch, a.prompt_len, a.completion_len
    first = 4  # past the special tokens
    vocab = model.get_input_embeddings().num_embeddings
    prompt_ids = torch.randint(first, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    comp_lens = (
        torch.randint(C // 2, C + 1, (B,), generator=g) if a.ragged else torch.full((B,), C)
    ).tolist()
    completion_ids = torch.full((B, C), tok.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, n in enumerate(comp_lens):
        completion_ids[i, :n] = torch.randint(first, vocab, (n,), generator=g)
        completion_mask[i, :n] = 1
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    rewards = torch.rand(B, generator=g)
    group = 8 if B % 8 == 0 else 2
    adv = torch.tensor(
        [x for k in range(0, B, group) for x in group_advantages(rewards[k : k + group].tolist())],
        dtype=torch.float32,
    )
    loss_mask = torch.zeros(B, P + C - 1)
    loss_mask[:, P - 1 :] = completion_mask.float()
    with torch.no_grad():
        cur = token_logprobs(model, ids, attn)
    behaviour = (
        cur + 0.1 * torch.randn(cur.shape, generator=g)
    ) * loss_mask  # a slightly stale sampler
    ours = LearnerBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=adv,
        rewards=rewards,
        versions=torch.zeros(B, dtype=torch.long),
    )
    trl_inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": adv,
        "sampling_per_token_logps": behaviour[:, P - 1 :].clone(),
    }
    return ours, trl_inputs


class TRLStep:
    """TRL's GRPO learner work for one generation batch, generation excluded."""

    def __init__(self, a: argparse.Namespace, model: Any, tok: Any, tmpdir: str):
        import torch
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.a = a
        args = GRPOConfig(
            output_dir=tmpdir,
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            activation_checkpointing=False,
            per_device_train_batch_size=a.batch // a.updates,
            steps_per_generation=a.updates,
            num_generations=2,
            max_completion_length=a.completion_len,
            loss_type="bnpo",
            beta=a.beta,
            epsilon=0.2,
            use_bias_correction_kl=False,
            learning_rate=a.lr,
            max_grad_norm=1.0,
            save_strategy="no",
            logging_steps=1,
            seed=a.seed,
        )
        optimizers = (
            (torch.optim.Adam(model.parameters(), lr=a.lr), None)
            if a.trl_optimizer == "adam"
            else (None, None)
        )
        ds = Dataset.from_dict({"prompt": ["1+2="] * a.batch})
        self.trainer = t = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=ds,
            processing_class=tok,
            optimizers=optimizers,
        )
        if t.optimizer is None:
            t.create_optimizer()
        t.current_gradient_accumulation_steps = 1  # one optimizer update per slice, as ours
        t._prepare_inputs = lambda inputs: (
            inputs
        )  # the slice is already prepared (generation skipped)
        # Truncated IS as ours (w = min(exp(old - behaviour), 2)): TRL's token_truncate correction.
        t.use_vllm = True
        t.vllm_importance_sampling_correction = True
        t.vllm_importance_sampling_mode = "token_truncate"
        t.vllm_importance_sampling_clip_max, t.vllm_importance_sampling_clip_min = 2.0, None
        if a.beta > 0 and t.ref_model is None:
            raise SystemExit("TRL built no reference model")

    def step(self, batch: dict[str, Any]) -> None:
        import torch
        from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

        t, model = self.trainer, self.trainer.model
        C = batch["completion_ids"].shape[1]
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        inputs = {k: v for k, v in batch.items() if k != "sampling_per_token_logps"}
        with torch.no_grad():  # as in _generate_and_score_completions (steps_per_generation > 1)
            old, _, _ = t._get_per_token_logps_and_entropies(
                model, ids, attn, C, batch_size=ids.shape[0]
            )
            mask = batch["completion_mask"]
            diff = torch.nan_to_num((old - batch["sampling_per_token_logps"]) * mask, nan=0.0)
            inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), max=2.0)
            inputs["old_per_token_logps"] = old
            if t.beta != 0.0:
                inputs["ref_per_token_logps"], _, _ = t._get_per_token_logps_and_entropies(
                    t.ref_model, ids, attn, C, batch_size=ids.shape[0]
                )
        inputs["num_items_in_batch"] = mask.sum()
        for chunk in split_tensor_dict(shuffle_sequence_dict(inputs), self.a.updates):
            t.training_step(model, chunk, chunk["num_items_in_batch"])
            t.accelerator.clip_grad_norm_(model.parameters(), t.args.max_grad_norm)
            t.optimizer.step()
            model.zero_grad()
        t._metrics["train"].clear()  # the HF loop empties these on every log


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine(threads: int) -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": threads,
    }
    try:
        import transformers
        import trl

        info.update(transformers=transformers.__version__, trl=trl.__version__)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    import copy
    import tempfile

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from echo_rl.core.config import LearnerConfig
    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.learner.trainer import Trainer

    console = Console()
    torch.set_num_threads(a.threads)
    load_before = _loadavg()
    tok = build_tiny_tokenizer()
    mcfg = model_config(a)
    base = build_model(a, mcfg, tok)
    n_params = sum(p.numel() for p in base.parameters())
    ours_batch, trl_batch = make_batch(a, base, tok)
    tokens = int(ours_batch.attention_mask.sum())
    trained = int(ours_batch.loss_mask.sum())

    ours = Trainer(
        copy.deepcopy(base),
        LearnerConfig(
            lr=a.lr,
            updates_per_step=a.updates,
            beta=a.beta,
            epsilon=0.2,
            is_cap=2.0,
            loss_agg="token-mean",
            fused_head=a.fused_head == "on",
        ),
        seed=a.seed,
    )
    with tempfile.TemporaryDirectory() as tmp:
        if a.beta > 0:  # TRL builds its reference model from the policy's path
            base.save_pretrained(tmp)
            trl_model = type(base).from_pretrained(tmp)
        else:
            trl_model = copy.deepcopy(base)
        theirs = TRLStep(a, trl_model, tok, os.path.join(tmp, "trl"))

        runners = {"ours": lambda: ours.step(ours_batch), "trl": lambda: theirs.step(trl_batch)}
        times: dict[str, list[float]] = {k: [] for k in runners}
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as prog:
            task = prog.add_task("warm-up", total=(a.warmup + a.reps) * len(runners))
            for rep in range(a.warmup + a.reps):
                timed = rep >= a.warmup
                prog.update(task, description="timing" if timed else "warm-up")
                # interleave (and alternate the order) so drift hits both sides alike
                for name in list(runners) if rep % 2 == 0 else list(reversed(runners)):
                    t0 = time.perf_counter()
                    runners[name]()
                    dt = time.perf_counter() - t0
                    if timed:
                        times[name].append(dt)
                    prog.advance(task)

    load_after = _loadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        k: {
            "median_step_s": med[k],
            "min_step_s": min(times[k]),
            "max_step_s": max(times[k]),
            "tokens_per_s": tokens / med[k],
            "trained_tokens_per_s": trained / med[k],
            "step_s": times[k],
        }
        for k in times
    }
    out = {
        "benchmark": "learner",
        "machine": {
            **machine(a.threads),
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": load_after,
        },
        "params": {
            "preset": a.preset,
            "model": mcfg.model_dump(),
            "n_params": n_params,
            "vocab": base.get_input_embeddings().num_embeddings,
            "batch": a.batch,
            "prompt_len": a.prompt_len,
            "completion_len": a.completion_len,
            "ragged": a.ragged,
            "updates_per_step": a.updates,
            "fused_head": a.fused_head,
            "beta": a.beta,
            "epsilon": 0.2,
            "is_cap": 2.0,
            "lr": a.lr,
            "trl_loss_type": "bnpo",
            "trl_optimizer": a.trl_optimizer,
            "warmup": a.warmup,
            "reps": a.reps,
            "tokens_per_step": tokens,
            "trained_tokens_per_step": trained,
        },
        "ours": res["ours"],
        "trl": res["trl"],
        "ratio": res["ours"]["tokens_per_s"] / res["trl"]["tokens_per_s"],
    }

    table = Table(
        title=f"Learner step: {a.batch} x ({a.prompt_len}+{a.completion_len}) tokens, "
        f"{a.updates} updates, {n_params / 1e6:.2f}M params, {a.threads} threads"
    )
    for col in ("", "median step (ms)", "min (ms)", "tokens/s", "trained tokens/s"):
        table.add_column(col, justify="right" if col else "left")
    for k, label in (
        ("ours", "ours (Trainer.step)"),
        ("trl", f"TRL {out['machine'].get('trl', '')} GRPO"),
    ):
        r = res[k]
        table.add_row(
            label,
            f"{r['median_step_s'] * 1e3:.1f}",
            f"{r['min_step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['trained_tokens_per_s']:,.0f}",
        )
    console.print(table)
    console.print(f"ratio ours/TRL (tokens/s, medians): [bold]{out['ratio']:.2f}[/bold]")
    busy = max(x for x in (load_before, load_after, 0.0) if x is not None)
    if busy > 0.5:
        console.print(
            f"[yellow]note: 1-minute load average was {busy:.2f} around the run; other processes "
            f"share the CPU, absolute figures are noisy (the interleaved ratio less so)[/yellow]"
        )

    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
