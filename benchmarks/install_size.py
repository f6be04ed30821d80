"""What a volunteer's `pip install` costs: time, site-packages size and packages, for the core
install of a git revision and of the working tree (docs/volunteers.md, pyproject.toml extras).

    .venv/bin/python benchmarks/install_size.py [--before REV]   # default REV: HEAD
        # writes benchmarks/results/install_size.json

Each side gets a fresh venv, torch==2.13.0 installed first (the README's rule: an unpinned
torch pulls a CUDA build), then a timed `pip install <source>` (no extras), from the package
index this machine uses (pip's cache warm or not, the same for both sides: run it twice and
take the second). Sizes include torch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OPTIONAL = ("scipy", "simpy", "matplotlib", "pandas", "pyarrow", "pokerkit")


def _sources(rev: str, tmp: Path) -> dict[str, Path]:
    before, after = tmp / "before", tmp / "after"
    before.mkdir()
    archive = subprocess.run(
        ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True
    ).stdout
    (tmp / "before.tar").write_bytes(archive)
    with tarfile.open(tmp / "before.tar") as tar:
        tar.extractall(before, filter="data")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (after / name).parent.mkdir(parents=True, exist_ok=True)
            (after / name).write_bytes(src.read_bytes())
    return {f"{rev} (before)": before, "working tree (after)": after}


def measure(source: Path, venv: Path) -> dict[str, object]:
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(pip + ["--upgrade", "pip"], check=True, capture_output=True)
    subprocess.run(pip + ["torch==2.13.0"], check=True, capture_output=True)
    t0 = time.monotonic()
    subprocess.run(pip + [str(source)], check=True, capture_output=True)
    seconds = time.monotonic() - t0
    site = next((venv / "lib").glob("python*/site-packages"))
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
    freeze = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    names = {line.split("==")[0].lower() for line in freeze}
    return {
        "install_s": round(seconds, 1),
        "site_packages_mb": round(size / 1e6),
        "packages": len(names),
        "optional_present": sorted(names & set(OPTIONAL)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/install_size.json")
    args = ap.parse_args(argv)
    from echo_rl.core.machine import write_result

    out = {}
    with tempfile.TemporaryDirectory(prefix="echo-install-") as tmp:
        for label, source in _sources(args.before, Path(tmp)).items():
            print(f"{label}: installing ...", flush=True)
            out[label] = measure(source, Path(tmp) / f"venv-{len(out)}")
            print(f"  {out[label]}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, {"argv": sys.argv[1:], "results": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
