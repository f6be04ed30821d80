"""Echo installs one import name, ``echo_rl`` (issue 53): its wheel's top_level.txt and files
name nothing else, and a fresh venv with an AdapterHub-style ``adapters`` package and PyPI's
``echo`` installed beside Echo imports all three, and Echo still finds its own adapters. Before
the rename, Echo's wheel carried top-level ``adapters`` and ``echo`` packages of its own: pip
wrote one distribution's files over the other's and one import broke.

Everything is built here, offline: Echo's wheel from this checkout and two stand-in wheels
whose top-level names are those of the distributions Echo once shadowed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NEIGHBOURS = {
    # distribution -> (top-level package, what it says when imported)
    "adapters": ("adapters", "AdapterHub-style adapters"),
    "echo": ("echo", "PyPI's echo"),
}


def pip(*args: str, python: Path | None = None) -> None:
    target = ["--python", str(python)] if python else []
    run = subprocess.run(
        [sys.executable, "-m", "pip", *target, *args, "-q", "--no-deps", "--no-index"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def neighbour_wheel(tmp: Path, dist: str, wheels: Path) -> None:
    top, says = NEIGHBOURS[dist]
    src = tmp / f"src-{dist}"
    (src / top).mkdir(parents=True)
    (src / top / "__init__.py").write_text(f"WHO = {says!r}\n")
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "9.9.9"

        [tool.setuptools]
        packages = ["{top}"]
        """)
    )
    pip("wheel", "--no-build-isolation", "-w", str(wheels), str(src))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    out = tmp / "wheels"
    # a copy of the checkout's tracked package files: building never writes into the checkout
    src = tmp / "echo-src"
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "pyproject.toml",
            "README.md",
            "echo_rl",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((ROOT / rel).read_bytes())
    pip("wheel", "--no-build-isolation", "-w", str(out), str(src))
    for dist in NEIGHBOURS:
        neighbour_wheel(tmp, dist, out)
    return out


def test_echo_s_wheel_has_one_top_level_name(wheels: Path) -> None:
    (wheel,) = wheels.glob("echo_rl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["echo_rl"]
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"echo_rl"}, tops
    assert "[echo_rl.adapters]" in entry_points and "echo_rl.adapters.toy_add:" in entry_points
    assert "echo_rl/core/dashboard/index.html" in names  # package data travels


def test_a_fresh_venv_imports_echo_beside_adapters_and_echo(wheels: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip("install", *map(str, sorted(wheels.glob("*.whl"))), python=python)
    # Echo's dependencies (pydantic, torch, ...) from this interpreter's environment, after the
    # venv's own packages on sys.path: only the three wheels above come first
    site = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(own, "zz_deps.pth").write_text("".join(f"{p}\n" for p in site))
    code = textwrap.dedent("""
        import adapters, echo, echo_rl
        from echo_rl.core.models import build_tiny_tokenizer
        from echo_rl.data.adapter import load_adapter
        print(adapters.WHO)
        print(echo.WHO)
        print(echo_rl.__file__)
        print(type(load_adapter("toy-add", {}, build_tiny_tokenizer())).__module__)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    run = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    who_adapters, who_echo, where, adapter = run.stdout.split("\n")[:4]
    assert (who_adapters, who_echo) == ("AdapterHub-style adapters", "PyPI's echo")
    assert where.startswith(own), where  # Echo from its wheel in the venv, not this checkout
    assert adapter == "echo_rl.adapters.toy_add"
