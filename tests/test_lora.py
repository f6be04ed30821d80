"""LoRA (issue 32): the learner trains a peft adapter on the frozen base model; a version is the
adapter's tensors plus the base model's content hash; workers and the auditor apply it to the
base they hold, after checking the hash (echo_rl/core/lora.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from echo_rl.broadcast.snapshot import RunKey, SnapshotError, build_manifest, verify_manifest  # noqa: E402
from echo_rl.core.config import ConfigError, EchoConfig, load_config  # noqa: E402
from echo_rl.core.models import params_to_payload  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def lora_cfg(**lora) -> EchoConfig:
    return EchoConfig.model_validate(
        {
            "learner": {
                "prompts_per_step": 2,
                "group_size": 2,
                "lr": 0.05,
                "device": "cpu",
                "lora": {"enabled": True, "rank": 4, **lora},
            },
            "worker": {"device": "cpu"},
            "broadcast": {"dtype": "float32", "chunk_mib": 0.00390625},
        }
    )


def batch_of(tokenizer, seed: int = 0):
    """Two groups of two samples with rewards 1 and 0: non-zero advantages."""
    from echo_rl.data.adapter import materialise_records
    from echo_rl.data.records import Record

    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(2):
        prompt = torch.randint(4, len(tokenizer), (4,), generator=g).tolist()
        groups.append(
            [
                Record(
                    group_id=f"g{k}",
                    sample_idx=i,
                    prompt_ids=prompt,
                    completion_ids=torch.randint(4, len(tokenizer), (5,), generator=g).tolist(),
                    logprobs=[-3.0] * 5,
                    reward=float(i),
                    version=0,
                    worker_id="w",
                )
                for i in range(2)
            ]
        )
    return groups, materialise_records(groups, [1.0, -1.0, 1.0, -1.0], tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def trained(tokenizer):
    """A LoRA policy after one learner step, and its state as a snapshot would carry it."""
    from echo_rl.learner.policy import Policy, Step

    policy = Policy(lora_cfg())
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    _, batch = batch_of(tokenizer)
    stats, full = policy.command(Step(batch, sync=True))
    return policy, before, stats, full


def test_lora_is_off_by_default_and_bad_settings_name_the_key():
    assert not EchoConfig().learner.lora.enabled
    assert EchoConfig().worker_view()["lora"]["enabled"] is False
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank = 0"):
        load_config(None, ["learner.lora.rank=0"])
    with pytest.raises(ConfigError, match=r'learner\.lora\.target_modules.*\["q_proj"\]'):
        load_config(None, ['learner.lora.target_modules="q_proj"'])
    with pytest.raises(ConfigError, match="did you mean 'learner.lora.alpha'"):
        load_config(None, ["learner.lora.alpah=8"])
    with pytest.raises(ConfigError, match="engine and transformers backends apply LoRA"):
        load_config(None, ["learner.lora.enabled=true", 'worker.backend="vllm"'])


def test_unknown_target_module_is_refused_with_the_model_s_linear_layers(tokenizer):
    from echo_rl.core.lora import wrap
    from echo_rl.core.models import ModelError, load_model

    model = load_model(EchoConfig().model, tokenizer)
    with pytest.raises(ModelError, match=r"target_modules = \['qkv'\].*q_proj"):
        wrap(model, lora_cfg(target_modules=["qkv"]).learner.lora)


def test_a_step_trains_the_adapter_only(trained):
    policy, before, stats, full = trained
    assert stats["loss"] == stats["loss"] and stats["skipped_nonfinite"] == 0
    assert policy.param_names and all(".lora_" in n for n in policy.param_names)
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(policy.param_names)  # the base never moves
    assert any(".lora_B." in n for n in changed)  # B starts at zero: the adapter now acts
    assert list(full[0]) == policy.param_names  # checkpoints and snapshots: the adapter alone
    opt_params = [p for g in policy.trainer.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(policy.param_names)


def test_a_version_is_the_adapter_plus_the_signed_base_hash(trained, tokenizer):
    from echo_rl.core.lora import base_hash
    from echo_rl.core.models import load_model

    policy, _, _, full = trained
    tensors, payload = params_to_payload(policy.named_tensors(full[0]), "bfloat16")
    base = load_model(EchoConfig().model, tokenizer)
    _, whole = params_to_payload(base.named_parameters(), "bfloat16")
    assert len(payload) < 0.2 * len(
        whole
    )  # rank 4 on a 64-wide toy; SmolLM2: benchmarks/lora_bytes.py
    assert policy.base_hash == base_hash(base) and len(policy.base_hash) == 64
    key = RunKey.generate()
    manifest = build_manifest(
        run_id="r",
        version=1,
        tensors=tensors,
        payload=payload,
        chunk_size=4096,
        dtype="bfloat16",
        key=key,
        base_model=policy.base_hash,
    )
    assert verify_manifest(manifest.to_wire(), key.public_bytes) == manifest
    forged = {**manifest.to_wire(), "base_model": "0" * 64}  # forged on purpose
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(forged, key.public_bytes)
    with pytest.raises(SnapshotError, match="base_model"):
        verify_manifest({**manifest.to_wire(), "base_model": "not hex"}, key.public_bytes)


def test_adapter_versions_go_as_deltas_and_rebuild_bit_exact(trained):
    from echo_rl.broadcast.versions import VersionEncoder, rebuild

    policy, _, _, full = trained
    enc = VersionEncoder(
        run_id="r",
        key=RunKey.generate(),
        chunk_size=4096,
        dtype="bfloat16",
        base_model=policy.base_hash,
    )
    tensors, v1 = params_to_payload(policy.named_tensors(full[0]), "bfloat16")
    moved = {n: t + 0.01 * (i % 3 == 0) for i, (n, t) in enumerate(full[0].items())}
    _, v2 = params_to_payload(policy.named_tensors(moved), "bfloat16")
    first, second = enc.build(1, tensors, v1), enc.build(2, tensors, v2)
    assert first.manifest.encoding == "full" and second.manifest.encoding == "delta"
    assert first.manifest.base_model == second.manifest.base_model == policy.base_hash
    assert len(second.payload) < len(v2)
    assert bytes(rebuild(second.manifest, second.payload, v1)) == v2


def test_worker_applies_the_version_to_its_base_and_generates_from_the_learner_s_policy(
    trained, tokenizer
):
    from echo_rl.core.lora import base_problem
    from echo_rl.worker.backends import make_backend

    policy, _, _, full = trained
    cfg = lora_cfg()
    backend = make_backend(
        "transformers", model_cfg=cfg.model, threads=1, device="cpu", lora=cfg.learner.lora
    )
    assert backend.base_hash == policy.base_hash
    tensors, payload = params_to_payload(policy.named_tensors(full[0]), "float32")
    assert base_problem(1, policy.base_hash, backend.base_hash, "tiny-qwen3") is None
    backend.install(tensors, payload, 1)
    ids = torch.tensor([[4, 9, 14, 5, 7, 12]])
    with torch.no_grad():
        torch.testing.assert_close(
            backend.model(input_ids=ids).logits,
            policy.model(input_ids=ids).logits,
            rtol=0,
            atol=1e-6,
        )
    other = make_backend(
        "transformers",
        model_cfg=cfg.model.model_copy(update={"seed": 1}),
        threads=1,
        device="cpu",
        lora=cfg.learner.lora,
    )
    problem = base_problem(1, policy.base_hash, other.base_hash, "tiny-qwen3")
    assert "hashes to" in problem and "learner's base model" in problem
    assert "applies LoRA" in base_problem(1, None, backend.base_hash, "m")
    assert "without an adapter" in base_problem(1, policy.base_hash, None, "m")


def test_auditor_recomputes_under_base_plus_the_claimed_adapter(trained, tokenizer):
    from echo_rl.control.auditor import Auditor

    policy, _, _, full = trained
    cfg = lora_cfg()
    groups, batch = batch_of(tokenizer, seed=3)
    rows = torch.arange(4)
    with torch.no_grad():
        truth = policy.trainer.logprobs(policy.model, batch, rows)
    aud = Auditor(cfg, tokenizer, lambda v: None)
    aud.add_snapshot(1, *params_to_payload(policy.named_tensors(full[0]), "float32"))
    records = [r for g in groups for r in g]
    stats = aud.token_stats(1, aud._snapshots[1], records)
    for i, (rec, s) in enumerate(zip(records, stats)):
        start = len(rec.prompt_ids) - 1
        expected = truth[i, start : start + len(rec.completion_ids)]
        torch.testing.assert_close(torch.tensor(s.logprob), expected, rtol=0, atol=1e-5)
    zero = {n: torch.zeros_like(t) for n, t in full[0].items()}  # another version: base alone
    aud.add_snapshot(0, *params_to_payload(policy.named_tensors(zero), "float32"))
    base_stats = aud.token_stats(0, aud._snapshots[0], records)
    assert base_stats[0].logprob != pytest.approx(stats[0].logprob, abs=1e-4)


def test_checkpoint_resumes_the_adapter_and_export_writes_it(trained, tokenizer, tmp_path):
    from peft import PeftModel

    from echo_rl.core.config import dump_toml
    from echo_rl.core.models import load_model
    from echo_rl.learner.checkpoint import export_checkpoint, save_checkpoint
    from echo_rl.learner.policy import Load, Policy

    policy, _, _, full = trained
    cfg = lora_cfg()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(cfg))
    save_checkpoint(run, 0, {"model": full[0], "optimizer": full[1], **policy.rng_state()})
    resumed = Policy(cfg)
    resumed.command(Load({"model": full[0], "optimizer": full[1], **policy.rng_state()}))
    ids = torch.tensor([[4, 9, 14, 5, 7]])
    with torch.no_grad():
        want = policy.model(input_ids=ids).logits
        torch.testing.assert_close(resumed.model(input_ids=ids).logits, want, rtol=0, atol=0)

    adapter = export_checkpoint(run, tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").exists() and not (
        adapter / "config.json"
    ).exists()
    loaded = PeftModel.from_pretrained(load_model(cfg.model, tokenizer), adapter)
    merged = export_checkpoint(run, tmp_path / "merged", merged=True)
    whole = load_model(cfg.model.model_copy(update={"name": str(merged)}), tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(whole(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    assert (merged / "adapter" / "adapter_config.json").exists()


def test_a_checkpoint_of_other_lora_settings_is_refused(trained):
    from echo_rl.learner.policy import Load, Policy

    policy, _, _, full = trained
    other = Policy(lora_cfg(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"resume with the \[learner.lora\] settings"):
        other.command(Load({"model": full[0], "optimizer": full[1], **policy.rng_state()}))


def test_the_bytes_benchmark_measures_published_versions(tmp_path):
    """benchmarks/lora_bytes.py on the tiny model (the SmolLM2 folder is not needed here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lora_bytes.py"
    spec = importlib.util.spec_from_file_location("lora_bytes", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure("tiny-qwen3", "lora", {"lr": 1e-3, "lora": {"enabled": True, "rank": 2}}, 1)
    assert [v["encoding"] for v in row["versions"]][0] == "full" and len(row["versions"]) == 2
    assert row["keyframe_bytes"] == 2 * row["trained_params"]  # bf16 adapter tensors only
    assert row["trained_params"] < row["total_params"] and len(row["base_hash"]) == 64


def test_base_hash_is_the_same_for_a_float32_and_a_bfloat16_load(tokenizer, tmp_path):
    """The learner loads float32, a GPU worker bfloat16: one base, one hash. Other weights
    (another seed) hash differently."""
    from echo_rl.core.lora import load_policy_model
    from echo_rl.core.models import ModelConfig, load_model

    load_model(ModelConfig(), tokenizer).save_pretrained(tmp_path / "m")
    folder = ModelConfig(name=str(tmp_path / "m"))
    lora = lora_cfg().learner.lora
    _, h32 = load_policy_model(folder, lora, tokenizer, "float32")
    model16, h16 = load_policy_model(folder, lora, tokenizer, "bfloat16")
    assert next(model16.parameters()).dtype == torch.bfloat16
    assert h32 == h16
    assert load_policy_model(ModelConfig(seed=1), lora, tokenizer)[1] != h32
    assert load_policy_model(folder, None, tokenizer)[1] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
def test_on_a_gpu_a_bf16_worker_holds_the_learner_s_base_and_follows_its_adapter(tokenizer):
    """The learner trains on the GPU (float32 weights, bf16 autocast); a worker on the GPU loads
    the base in bf16: the same base hash, and after installing the bf16 adapter version its
    log-probs are the learner's within bf16 noise."""
    from echo_rl.learner.policy import Policy, Step
    from echo_rl.learner.trainer import token_logprobs
    from echo_rl.worker.backends import make_backend

    cfg = lora_cfg()
    cfg.learner.device = "cuda"
    policy = Policy(cfg)
    _, batch = batch_of(tokenizer)
    _, full = policy.command(Step(batch, sync=True))
    backend = make_backend(
        "transformers", model_cfg=cfg.model, device="cuda", lora=cfg.learner.lora
    )
    assert next(backend.model.parameters()).dtype == torch.bfloat16
    assert backend.base_hash == policy.base_hash
    backend.install(*params_to_payload(policy.named_tensors(full[0]), "bfloat16"), 1)
    ids, attn = batch.input_ids.cuda(), batch.attention_mask.cuda()
    with torch.no_grad():
        want = token_logprobs(policy.model, ids, attn)
        got = token_logprobs(backend.model, ids, attn)
    assert float((want - got).abs().mean()) < 0.05


def test_a_worker_holding_another_base_stops_with_the_fix():
    """The installer's check before an install: a mismatch is a WorkerError (out of its install
    try, so it ends the worker with the message), not a version skipped and retried forever."""
    from types import SimpleNamespace

    from echo_rl.worker.install import check_base
    from echo_rl.worker.session import WorkerError

    backend = SimpleNamespace(base_hash="a" * 64)
    check_base(SimpleNamespace(version=3, base_model="a" * 64), backend, "models/base")
    with pytest.raises(WorkerError, match="models/base.*hashes to aaaa.*learner's base model"):
        check_base(SimpleNamespace(version=3, base_model="b" * 64), backend, "models/base")


def test_evaluation_models_play_a_lora_run_with_its_adapter(trained, tokenizer, tmp_path):
    """echo_rl/adapters/hf.py (echo-rl eval, frozen opponents) on a LoRA run folder: its base with the
    latest checkpoint's adapter; untrained, the base alone."""
    from echo_rl.adapters.hf import HFModel
    from echo_rl.core.config import dump_toml
    from echo_rl.core.models import load_model
    from echo_rl.learner.checkpoint import save_checkpoint

    policy, _, _, full = trained
    cfg = lora_cfg()
    (tmp_path / "config.toml").write_text(dump_toml(cfg))
    save_checkpoint(tmp_path, 0, {"model": full[0], "optimizer": full[1]})
    ids = torch.tensor([[4, 9, 14, 5, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            HFModel(str(tmp_path)).model(input_ids=ids).logits,
            policy.model(input_ids=ids).logits,
            rtol=0,
            atol=1e-6,
        )
        torch.testing.assert_close(
            HFModel(str(tmp_path), untrained=True).model(input_ids=ids).logits,
            load_model(cfg.model, tokenizer)(input_ids=ids).logits,
            rtol=0,
            atol=1e-6,
        )
