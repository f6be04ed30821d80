"""Host memory of a worker process serving two LoRA runs on one base model, with the base
shared (echo_rl/worker/backends/shared_base.py) and without (docs/multirun.md).

    .venv/bin/python benchmarks/lora_shared_base.py [--model models/smollm2-135m-instruct]

Each case runs in a fresh process: it loads two transformers backends with LoRA on the model
(float32, the CPU's dtype) and prints its resident set after each. Writes
benchmarks/results/lora_shared_base.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import write_result  # noqa: E402

CHILD = """
import json, sys
from echo_rl.core.config import LoraConfig, ModelConfig
from echo_rl.core.memstat import resident
from echo_rl.broadcast.memory import trim
rss_bytes = lambda: (trim(), resident()["rss_anon"])[1]
import echo_rl.worker.backends.transformers as tb
from echo_rl.worker.backends.shared_base import SharedBases
share = sys.argv[2] == "shared"
rows = [rss_bytes()]
backends = []
for _ in range(2):
    if not share:
        tb.SHARED = SharedBases()  # a registry per backend: nothing shared
    backends.append(tb.TransformersBackend(ModelConfig(name=sys.argv[1]), lora=LoraConfig(enabled=True)))
    rows.append(rss_bytes())
print(json.dumps({"rss": rows, "shared_bytes": backends[1].shared_bytes}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/lora_shared_base.json")
    args = ap.parse_args(argv)
    out = {}
    for case in ("separate", "shared"):
        run = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, case],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[case] = json.loads(run.stdout.strip().splitlines()[-1])
        rss = [r / 2**20 for r in out[case]["rss"]]
        print(
            f"{case:9} RSS MiB: start {rss[0]:.0f}, one run {rss[1]:.0f}, two runs {rss[2]:.0f}"
            f" (second run +{rss[2] - rss[1]:.0f} MiB)",
            flush=True,
        )
    write_result(
        args.json, {"generated_by": "benchmarks/lora_shared_base.py", "model": args.model, **out}
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
