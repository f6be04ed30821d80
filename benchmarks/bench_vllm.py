"""Rollout tokens/s with vLLM against the transformers backend, on the same GPU and model, and
the time to install a snapshot into the running engine against the model's size (issue 14).

Each backend is the worker's own (``echo_rl/worker/backends``), fed the same groups (prompts of the
math task's length, ``n`` samples each, ``--max-new-tokens``); tokens/s counts generated tokens
(to end-of-sequence or the limit) over the wall time of ``generate``, after one warm-up call.
Installs time the whole ``Backend.install`` of a bf16 snapshot of the same model (the write to
shared memory and the engine's load for vLLM; the copy into parameters for transformers).

Models: the SmolLM2-135M-Instruct folder (``echo-rl model import-gguf``) and a random-init
Qwen3 of about 1B parameters written to a cache folder (``--sizes``), to show the gap at size.

    python benchmarks/bench_vllm.py [--backends vllm transformers] [--models smollm2 1b]
        [--groups 32 --n 8 --max-new-tokens 256] [--json benchmarks/results/vllm/bench.json]

On a machine without CUDA, ``--backends transformers --models tiny`` checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
# About 1.0B parameters in Qwen3's shape (Qwen3-1.7B's width, fewer layers, tied embedding).
ONE_B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def model_folder(name: str, cache: Path) -> Any:
    from echo_rl.core.config import ModelConfig

    if name == "tiny":
        return ModelConfig()
    if name == "smollm2":
        if not (SMOLLM2 / "config.json").is_file():
            raise SystemExit(f"{SMOLLM2} is missing: run echo-rl model import-gguf first (README)")
        return ModelConfig(name=str(SMOLLM2))
    if name == "1b":
        return ModelConfig(name=str(random_qwen3(cache / "qwen3-1b-random", ONE_B)))
    raise SystemExit(f"unknown model {name!r}: tiny, smollm2 or 1b")


def random_qwen3(folder: Path, shape: dict[str, int]) -> Path:
    """A random-init Qwen3 with SmolLM2's tokenizer (its vocabulary fits in 151,936 rows)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(folder)
    return folder


def make_groups(tok: Any, count: int, n: int) -> list[Any]:
    from echo_rl.core import wire

    texts = [
        f"Solve step by step: what is {17 * i + 3} times {i + 11}, minus {i}?" for i in range(count)
    ]
    return [
        wire.Group(group_id=f"g{i}", prompt_ids=tok.encode(t), n=n, seed=i)
        for i, t in enumerate(texts)
    ]


def make(backend: str, cfg: Any) -> Any:
    from echo_rl.worker.backends import make_backend

    extra = {"gpu_memory_utilization": 0.6} if backend == "vllm" else {}
    return make_backend(
        backend, model_cfg=cfg, threads=8, device="cuda" if backend == "vllm" else "auto", **extra
    )


def measure(backend_name: str, cfg: Any, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from echo_rl.core.models import load_model, load_tokenizer, params_to_payload

    b = make(backend_name, cfg)
    src = load_model(cfg, load_tokenizer(cfg), "float32")
    index, payload = params_to_payload(src.named_parameters(), "bfloat16")
    del src
    installs = []
    for v in range(1, a.installs + 1):
        t0 = time.perf_counter()
        b.install(index, payload, version=v)
        installs.append(time.perf_counter() - t0)
    groups = make_groups(b.tokenizer, a.groups, a.n)
    b.generate(groups[:2], 8, 1.0)  # warm-up (CUDA graphs, kernels)
    runs = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        out = b.generate(groups, a.max_new_tokens, 1.0)
        dt = time.perf_counter() - t0
        runs.append({"tokens": sum(len(s.completion_ids) for g in out for s in g), "seconds": dt})
    del b
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "backend": backend_name,
        "model": cfg.name,
        "snapshot_bytes": len(payload),
        "params": sum(e["nbytes"] for e in index) // 2,
        "install_s": installs,
        "install_median_s": statistics.median(installs),
        "runs": runs,
        "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
    }


def table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="rollout throughput and snapshot install")
    for col in ("model", "backend", "snapshot MB", "install s", "tokens/s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            Path(r["model"]).name,
            r["backend"],
            f"{r['snapshot_bytes'] / 1e6:,.0f}",
            f"{r['install_median_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    Console().print(t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backends", nargs="+", default=["vllm", "transformers"])
    ap.add_argument("--models", nargs="+", default=["smollm2", "1b"])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--installs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / "models" / "bench"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "vllm" / "bench.json"))
    a = ap.parse_args()
    import torch  # noqa: F401 (loaded first so machine_info can name the GPU)

    from echo_rl.core.machine import write_result

    rows = []
    for m in a.models:
        cfg = model_folder(m, Path(a.cache))
        for be in a.backends:
            rows.append(measure(be, cfg, a))
            print(
                json.dumps(
                    {
                        k: rows[-1][k]
                        for k in ("model", "backend", "tokens_per_s", "install_median_s")
                    }
                ),
                flush=True,
            )
    table(rows)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        out,
        {
            "command": " ".join(sys.argv),
            "settings": {k: getattr(a, k) for k in ("groups", "n", "max_new_tokens")},
            "rows": rows,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
