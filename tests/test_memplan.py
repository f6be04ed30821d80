"""Memory plans and budgets (echo_rl/core/memplan.py, docs/memory.md): what a learner or a worker says it
needs at start-up, what a budget changes, and the refusal when nothing fits."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from echo_rl.core.memplan import (
    FIXED_BYTES,
    GIB,
    HostBudget,
    LearnerPlan,
    MemoryBudgetError,
    ModelShape,
    WorkerPlan,
    fit_learner,
    fit_worker,
    folder_params,
)

pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape(params=420_000_000, trained=420_000_000, layers=20, hidden=1280)


def plan(**kw) -> LearnerPlan:
    return LearnerPlan(
        **{
            "shape": SHAPE,
            "payload": 2 * SHAPE.trained,
            "rows": 8,
            "minibatch_rows": 32,
            "seq_tokens": 272,
            "checkpointing": False,
            **kw,
        }
    )


def test_a_learner_plan_counts_training_state_payload_and_step():
    p = plan()
    parts = p.breakdown()
    assert parts["training_state"] == 16 * SHAPE.params  # float32 weights, grads, two moments
    assert parts["payloads"] == 2 * SHAPE.params
    assert p.total == sum(parts.values())
    assert plan(checkpointing=True).breakdown()["step"] < parts["step"]
    assert plan(rows=1).breakdown()["step"] < parts["step"]
    lora = plan(shape=ModelShape(SHAPE.params, 1_000_000, 20, 1280), payload=2_000_000)
    assert lora.breakdown()["training_state"] == 4 * SHAPE.params + 12 * 1_000_000
    assert plan(versions_in_ram=4).breakdown()["payloads"] == 5 * parts["payloads"]
    assert "training state 6.26 GiB" in p.describe()
    # one pass per mini-batch runs after the step frees the previous gradients: activations
    # that fit in that room cost nothing more; the same rows in two passes do
    short = dict(rows=2, seq_tokens=16)
    assert (
        plan(minibatch_rows=2, **short).breakdown()["step"]
        < plan(minibatch_rows=4, **short).breakdown()["step"]
    )


def test_a_budget_turns_checkpointing_on_then_passes_fewer_rows():
    p = plan()
    assert fit_learner(p, 0) is p  # no budget: as configured
    assert fit_learner(p, p.total / GIB + 0.01) is p  # fits: as configured
    ckpt = plan(checkpointing=True)
    assert fit_learner(p, ckpt.total / GIB) == ckpt
    two = plan(checkpointing=True, rows=2)
    got = fit_learner(p, two.total / GIB)
    assert got.checkpointing and got.rows == 2  # 8 -> 4 -> 2: the first that fits


def test_a_learner_that_cannot_fit_is_refused_with_what_it_needs():
    with pytest.raises(MemoryBudgetError) as err:
        fit_learner(plan(), 4.0)  # below the training state alone
    text = str(err.value)
    assert "learner.host_memory_gb = 4" in text and "training state 6.26 GiB" in text
    assert "learner.lora.enabled = true" in text


def test_a_worker_over_budget_generates_in_bfloat16_unless_the_run_fixes_its_dtype():
    p = WorkerPlan(params=SHAPE.params, dtype_bytes=4, payload=2 * SHAPE.params, spill=True)
    assert p.breakdown()["model"] == 4 * SHAPE.params
    assert fit_worker(p, 0, dtype_fixed=False) is p
    half = fit_worker(p, 2.5, dtype_fixed=False)
    assert half.dtype_bytes == 2 and half.total <= 2.5 * GIB < p.total
    with pytest.raises(MemoryBudgetError, match="--host-memory-gb 2.5"):
        fit_worker(p, 2.5, dtype_fixed=True)
    with pytest.raises(MemoryBudgetError, match="more memory"):
        fit_worker(p, 1.0, dtype_fixed=False)  # not even in bfloat16
    gpu = WorkerPlan(SHAPE.params, 2, 2 * SHAPE.params, spill=True, model_on_host=False)
    assert gpu.breakdown()["model"] == 0 and "GPU memory" in gpu.describe()
    unspilled = WorkerPlan(SHAPE.params, 4, 2 * SHAPE.params, spill=False)
    assert unspilled.breakdown()["payloads"] == 2 * p.breakdown()["payloads"]


def test_runs_in_one_process_share_its_budget_with_the_fixed_part_counted_once():
    """docs/multirun.md: a volunteer's --host-memory-gb covers every run it joined. Two runs
    that each fit alone do not fit together: the second is refused, naming the first; a
    smaller one fits in what is left (its auto dtype falling to bfloat16 where that fits); a
    run loaded again replaces its own booking; a GPU run's model counts in host memory (it
    is parked there when not resident)."""
    run = WorkerPlan(params=SHAPE.params, dtype_bytes=2, payload=2 * SHAPE.params, spill=True)
    alone = run.total / GIB
    budget = HostBudget(alone * 1.5)
    assert budget.fit("a", run, dtype_fixed=True) == run
    with pytest.raises(MemoryBudgetError, match=r"shared by the runs.*a 1\.\d+ GiB already"):
        budget.fit("b", run, dtype_fixed=True)
    small = WorkerPlan(params=SHAPE.params // 2, dtype_bytes=4, payload=SHAPE.params, spill=True)
    got = budget.fit("c", small, dtype_fixed=False)
    assert got.dtype_bytes == 2 < small.dtype_bytes  # fitted into what "a" leaves
    assert sum(budget.runs.values()) + FIXED_BYTES <= budget.budget_gb * GIB
    assert budget.fit("a", run, dtype_fixed=True) == run and set(budget.runs) == {"a", "c"}
    gpu = HostBudget(0).fit(
        "g", WorkerPlan(SHAPE.params, 2, 0, spill=True, model_on_host=False), True
    )
    assert gpu.model_on_host and gpu.breakdown()["model"] == 2 * SHAPE.params


def test_folder_params_reads_safetensors_headers_only(tmp_path):
    header = {
        "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)  # no data
    assert folder_params(tmp_path) == 17
    assert folder_params(tmp_path / "missing") == 0


def test_a_policy_over_budget_trains_with_checkpointing(small_cfg):
    from echo_rl.learner.policy import Policy, plan_memory

    asked = Policy(small_cfg).memory_plan
    small_cfg.learner.host_memory_gb = (
        fit_learner(LearnerPlan(**{**asked.__dict__, "checkpointing": True}), 0).total / GIB
    )
    policy = Policy(small_cfg)
    assert policy.memory_refit and policy.memory_plan.checkpointing
    on = getattr(policy.model, "is_activation_checkpointing", None)  # transformers 5's name
    assert policy.trainer.cfg.gradient_checkpointing and (
        policy.model.is_gradient_checkpointing if on is None else on
    )
    assert plan_memory(small_cfg, policy.model, 1).rows == policy.memory_plan.rows


@pytest.mark.integration
def test_echo_rl_learn_refuses_a_budget_nothing_fits(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "learn",
            "examples/quickstart.toml",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "learner.host_memory_gb=0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "echo-rl learn: learner.host_memory_gb = 0.1, but this run needs about" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_worker_fits_its_dtype_to_the_volunteers_budget(tmp_path):
    from echo_rl.worker.model import LoadChoice, fit_memory
    from echo_rl.worker.session import WorkerError

    size = (2 * 10_000_000, "bfloat16")  # 10 M parameters in bf16

    def fit(dtype: str, budget_gb: float) -> str:
        return fit_memory(
            "tiny-qwen3",
            dtype,
            "cpu",
            False,
            view={},
            version_bytes=size,
            choice=LoadChoice(host_memory_gb=budget_gb, spill=True),
        )

    fp32 = WorkerPlan(10_000_000, 4, 20_000_000, spill=True).total
    assert fit("auto", 0.0) == "float32"  # no budget
    assert fit("auto", (fp32 - 1) / GIB) == "bfloat16"  # a byte short of float32
    with pytest.raises(WorkerError, match="--host-memory-gb"):
        fit("float32", (fp32 - 1) / GIB)  # the run fixed the dtype


@pytest.mark.integration
def test_a_worker_over_its_budget_leaves_and_the_run_goes_on(tmp_path, small_cfg):
    from test_integration import Cluster, wait_rows

    from echo_rl.core.procs import python_argv

    cluster = Cluster(tmp_path, small_cfg)
    try:
        run = cluster.learner(max_steps=10_000)
        proc = cluster.group.start(
            "small",
            python_argv(
                "echo_rl.cli.worker",
                "join",
                cluster.endpoint,
                "--id",
                "small",
                "--plain",
                "--host-memory-gb",
                "0.2",
                "--identity",
                str(tmp_path / "small.key"),
            ),
            tmp_path / "small.log",
        )
        assert proc.wait(60) != 0
        log = (tmp_path / "small.log").read_text()
        assert "--host-memory-gb 0.2, but serving this run needs about" in log, log[-2000:]
        cluster.worker("w0")  # the learner serves the next volunteer as before
        wait_rows(run, 2)
    finally:
        cluster.group.stop_all()


def test_lora_runs_on_one_base_book_it_once():
    """echo_rl/worker/backends/shared_base.py holds one base for the LoRA runs of a process that
    share it; the budget books it once (docs/multirun.md, "Residency")."""
    base = 2 * SHAPE.params  # the base in bfloat16
    run = WorkerPlan(params=SHAPE.params, dtype_bytes=2, payload=1 << 20, spill=True)
    budget = HostBudget((FIXED_BYTES + base + (10 << 20)) / GIB)  # one base and the payloads
    budget.fit("a", run, dtype_fixed=True)
    budget.loaded("a", "h", saved=0)  # the first holds the base
    # Known before loading (a fetched base's manifest): b books its payloads only.
    assert budget.fit("b", run, dtype_fixed=True, base="h").dtype_bytes == 2
    budget.loaded("b", "h", saved=base)
    assert budget.runs["b"] == (1 << 20) and budget.runs["a"] == base + (1 << 20)
    # Known only once loaded: booked in full, then the shared bytes come off.
    roomy = HostBudget(0)
    roomy.fit("a", run, dtype_fixed=True)
    roomy.loaded("a", "h", 0)
    roomy.fit("c", run, dtype_fixed=True)
    assert roomy.runs["c"] == base + (1 << 20)
    roomy.loaded("c", "h", saved=base)
    assert roomy.runs["c"] == 1 << 20
    # Booked on the shared base but not shared (another dtype): booked in full, or refused.
    with pytest.raises(MemoryBudgetError, match="could not be shared.*--dtype"):
        budget.fit("d", run, dtype_fixed=True, base="h")
        budget.loaded("d", "h", saved=0)
    roomy.fit("e", run, dtype_fixed=True, base="h")
    roomy.loaded("e", "h", saved=0)
    assert roomy.runs["e"] == base + (1 << 20)
    # Another base is not the first's.
    roomy.fit("f", run, dtype_fixed=True, base="other")
    assert roomy.runs["f"] == base + (1 << 20)
