from pathlib import Path

import pytest

from echo_rl.core.config import ConfigError, EchoConfig, dump_toml, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_example_loads_and_matches_documented_task():
    cfg = load_config(ROOT / "examples/quickstart.toml")
    assert cfg.adapter.name == "toy-add"
    assert cfg.learner.effective_kappa == max(1, cfg.learner.staleness - 1)


def test_overrides_are_parsed_as_toml_values():
    cfg = load_config(None, ["learner.max_steps=7", "model.name=/some/dir", "learner.lr=0.5"])
    assert cfg.learner.max_steps == 7 and cfg.learner.lr == 0.5
    assert cfg.model.name == "/some/dir"


def test_unknown_key_names_key_and_suggests_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.max_step=7"])
    assert "learner.max_step" in str(e.value) and "learner.max_steps" in str(e.value)


def test_a_renamed_key_names_the_new_key_and_its_value(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[broadcast]\nchunk_kib = 256\n")
    with pytest.raises(
        ConfigError,
        match=r"broadcast.chunk_kib is now broadcast.chunk_mib "
        r"\(KiB / 1024\): write chunk_mib = 0.25",
    ):
        load_config(old)
    with pytest.raises(ConfigError, match="chunk_mib = 0.09765625"):
        load_config(None, ["broadcast.chunk_kib=100"])


def test_chunks_are_whole_kib_in_mib():
    assert load_config(None, ["broadcast.chunk_mib=0.25"]).broadcast.chunk_bytes == 256 * 1024
    assert EchoConfig().broadcast.chunk_bytes == 2**20
    with pytest.raises(ConfigError, match="whole number of KiB"):
        load_config(None, ["broadcast.chunk_mib=0.1"])


def test_bad_value_names_key_value_and_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.staleness=-1"])
    msg = str(e.value)
    assert "learner.staleness" in msg and "-1" in msg and "--set learner.staleness" in msg


def test_staleness_zero_is_synchronous_with_one_publication_per_step():
    cfg = load_config(None, ["learner.staleness=0"])
    assert cfg.learner.effective_kappa == 1
    with pytest.raises(ConfigError, match="kappa"):
        load_config(None, ["learner.staleness=0", "learner.kappa=2"])


def test_cross_field_rule_kappa_within_staleness():
    with pytest.raises(ConfigError, match="kappa"):
        load_config(None, ["learner.staleness=2", "learner.kappa=3"])


def test_buffer_must_hold_one_step():
    with pytest.raises(ConfigError, match="capacity_groups"):
        load_config(None, ["buffer.capacity_groups=4", "learner.prompts_per_step=8"])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\nx=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_dump_round_trips(tmp_path):
    cfg = load_config(ROOT / "examples/quickstart.toml", ["learner.max_steps=3"])
    p = tmp_path / "c.toml"
    p.write_text(dump_toml(cfg))
    assert load_config(p) == cfg
    assert isinstance(cfg, EchoConfig)


def test_config_reference_is_generated_from_the_code(tmp_path, capsys):
    """docs/config.md is what echo_rl.core.config_doc prints: a key added without regenerating it fails."""
    from pathlib import Path

    from echo_rl.core import config_doc

    page = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert config_doc.main(["--check", str(page)]) == 0
    stale = tmp_path / "config.md"
    stale.write_text(page.read_text().replace("| `max_new_tokens` |", "| `max_tokens` |"))
    assert config_doc.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    text = page.read_text()
    for key in ("`staleness`", "`is_mode`", "`nat_traversal`", "`strikes`", "`presets`"):
        assert key in text, key


def test_a_tasks_preset_carries_its_generation_settings():
    """Switching task is one line: each preset brings its own max_new_tokens, which [worker] or
    --set still override; a misspelt generation key is named with the fix."""
    from pathlib import Path

    qs = Path(__file__).resolve().parents[1] / "examples" / "quickstart.toml"
    lengths = {
        name: load_config(qs, [f'adapter.name="{name}"']).worker.max_new_tokens
        for name in ("toy-add", "math", "poker")
    }
    assert lengths == {"toy-add": 4, "math": 6, "poker": 5}
    math = load_config(qs, ['adapter.name="math"'])
    assert "generation" not in math.adapter.effective_options  # not an option of the adapter
    assert math.worker_view()["worker"]["max_new_tokens"] == 6  # what workers are told
    assert (
        load_config(qs, ['adapter.name="math"', "worker.max_new_tokens=9"]).worker.max_new_tokens
        == 9
    )
    with pytest.raises(
        ConfigError, match=r"generation\.max_tokens is not a generation setting: use max_new_tokens"
    ):
        load_config(qs, ['adapter.name="math"', "adapter.presets.math.generation.max_tokens=3"])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(qs, ['adapter.name="math"', "adapter.presets.math.generation.max_new_tokens=0"])


def test_a_run_says_what_its_config_changes_from_the_defaults(capsys, caplog):
    """Issue 56: the quickstart's learner.beta = 0.1 lives in its file, and a config written
    from scratch started from 0.0 without a word. The learner now prints, at start, how many
    keys differ from the defaults and the first of them, and logs every one."""
    import logging

    from echo_rl.core.config_toml import differences
    from echo_rl.learner.startup import say_config

    quick = load_config(ROOT / "examples/quickstart.toml", [])
    diff = {k: (v, d) for k, v, d in differences(quick)}
    assert diff["learner.beta"] == (0.1, 0.0) and diff["model.max_positions"] == (512, 64)
    assert "learner.lr" not in diff  # the quickstart sets it to the default: no difference
    assert not any(k.startswith("adapter.presets") for k in diff)
    scratch = EchoConfig.model_validate({"adapter": {"name": "math"}})
    assert [k for k, _, _ in differences(scratch)] == ["adapter.name"]
    with caplog.at_level(logging.INFO, logger="echo.learner"):
        line = say_config(quick)
    assert line in capsys.readouterr().err
    assert "in 12 keys" in line and "learner.beta = 0.1 (default 0.0)" in line
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: ")]
    assert len(logged) == len(diff) and "config: learner.beta = 0.1 (default 0.0)" in logged
    assert "this config is the defaults" in say_config(EchoConfig())


def test_stochastic_rounding_is_unbiased_reproducible_and_only_for_float32_to_bf16():
    """broadcast.rounding = "stochastic" (docs/broadcast.md, "Snapshot precision"): a weight
    a quarter unit above a bf16 value is sent up a quarter of the time, so the mean of what is
    sent is the weight (to nearest it always goes down: the update is lost); the same seed
    gives the same bytes; other casts round to nearest."""
    import torch

    from echo_rl.core.models import cast_weights, params_to_payload

    unit = 2.0**-7  # a bf16 unit at 1.0
    w = torch.full((200_000,), 1.0 + 0.25 * unit)
    nearest = cast_weights(w, "bfloat16").float()
    sent = cast_weights(w, "bfloat16", seed=7).float()
    assert bool((nearest == 1.0).all())  # the quarter unit never shows
    assert set(sent.unique().tolist()) == {1.0, 1.0 + unit}
    assert abs(float(sent.mean()) - float(w[0])) < 0.02 * unit  # unbiased
    neg = cast_weights(-w, "bfloat16", seed=8).float()
    assert abs(float(neg.mean()) + float(w[0])) < 0.02 * unit  # the sign is kept
    assert torch.equal(cast_weights(w, "bfloat16", seed=7), cast_weights(w, "bfloat16", seed=7))
    assert torch.equal(cast_weights(w, "float16", seed=7), w.to(torch.float16))
    named = [("a", w[:10]), ("b", w[:10])]
    _, one = params_to_payload(named, "bfloat16", seed=3)
    _, two = params_to_payload(named, "bfloat16", seed=3)
    assert one == two and one[:20] != one[20:40]  # per tensor a stream of its own
    cfg = load_config(None, ['broadcast.rounding="stochastic"'])
    assert cfg.broadcast.rounding == "stochastic"
    with pytest.raises(ConfigError, match="rounding"):
        load_config(None, ['broadcast.rounding="down"'])


def test_dithered_rounding_is_unbiased_and_changes_only_the_weights_that_moved_past_theirs():
    """broadcast.rounding = "dither", the default: one threshold per weight for the whole run.
    Across weights it is as unbiased as stochastic rounding, a weight on the bf16 grid is sent
    exactly, and a version whose weights moved a little changes only those that crossed their
    threshold, where fresh noise per version (stochastic) changes a share of all of them."""
    import torch

    from echo_rl.core.models import cast_weights, rounding_seed

    assert load_config(None, []).broadcast.rounding == "dither"
    unit = 2.0**-7
    seed = {v: rounding_seed(0, "dither", v) for v in (1, 2)}
    assert seed[1] == seed[2] != rounding_seed(0, "stochastic", 1)
    assert rounding_seed(0, "nearest", 1) is None
    w = torch.full((200_000,), 1.0 + 0.25 * unit)
    sent = cast_weights(w, "bfloat16", seed=seed[1]).float()
    assert abs(float(sent.mean()) - float(w[0])) < 0.02 * unit  # unbiased across weights
    on_grid = torch.full((1000,), 1.0 + 3 * unit)
    assert torch.equal(cast_weights(on_grid, "bfloat16", seed=seed[1]).float(), on_grid)
    moved = w + 0.05 * unit  # the next version: every weight a twentieth of a unit further
    again = cast_weights(moved, "bfloat16", seed=seed[2]).float()
    changed = float((again != sent).float().mean())
    assert 0.03 < changed < 0.07  # those whose threshold lay in the twentieth crossed it
    assert bool((again >= sent).all())  # and only upwards, as the weights moved
    fresh = cast_weights(moved, "bfloat16", seed=rounding_seed(0, "stochastic", 2)).float()
    assert float((fresh != sent).float().mean()) > 0.3  # fresh noise: a share of all of them
