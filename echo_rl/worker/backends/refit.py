"""Snapshot refit for an inference engine: the parts that need neither CUDA nor vLLM.

The vLLM backend (``echo_rl/worker/backends/vllm.py``) installs a verified snapshot into the running
engine in three steps, each here as plain code that ``make test`` covers on the CPU:

1. **Names** (``map_names``). A snapshot's tensor index uses the learner's parameter names, which
   are the Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj.weight``). vLLM's
   ``load_weights`` takes exactly those and fuses q/k/v and gate/up itself, so the mapping is
   the identity after removing wrapper prefixes a trainer can add (``_orig_mod.`` from
   ``torch.compile``, ``module.`` from DDP). A tied ``lm_head.weight`` is dropped: the engine
   ties it to the embedding. On the first install the name set is compared with the checkpoint
   folder the engine loaded, so a snapshot of another model fails loudly instead of silently
   loading half the weights.
2. **Layout** (``build_layout``, ``write_shared``). The payload is written once into a file in
   ``/dev/shm`` with every tensor at a 64-byte-aligned offset, and the engine process is sent
   only the path and a primitive index (names, dtypes, shapes, offsets): no tensor is pickled
   and no gigabytes cross vLLM's RPC socket (docs/worker.md, "vLLM backend").
3. **Versions** (``VersionBook``). Generation and installs are serialised by one lock: a
   request in flight when a snapshot arrives finishes on the weights it started with, and the
   version it reports is the one stamped when it was dispatched. The book counts installs and
   how long installs waited for generation.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from echo_rl.core.errors import EchoError
from echo_rl.core.layout import TensorLayout

ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's element size
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DistributedDataParallel
TIED_HEAD = "lm_head.weight"
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class RefitError(EchoError, ValueError):
    """A snapshot that does not fit the engine's model, or a refit the engine did not finish."""

    default_reason = "refit"


@dataclass(frozen=True)
class Entry:
    """One tensor in the shared file, as the engine process receives it (primitives only)."""

    name: str  # the name vLLM's load_weights expects
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the shared file, ALIGN-aligned
    nbytes: int
    src_offset: int  # in the snapshot payload

    def wire(self) -> tuple[str, str, list[int], int, int]:
        return (self.name, self.dtype, list(self.shape), self.offset, self.nbytes)


# ----------------------------------------------------------------------------- names


def engine_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def map_names(
    index: list[TensorLayout], tied: bool, expected: set[str] | None = None
) -> list[tuple[TensorLayout, str]]:
    """(index entry, engine name) for every tensor the engine must load.

    ``expected`` is the checkpoint's name set (``checkpoint_names``); when given, the snapshot
    must carry every one of them and nothing else, or ``RefitError`` names the difference.
    """
    out, seen = [], set()
    for e in index:
        name = engine_name(str(e["name"]))
        if tied and name == TIED_HEAD:
            continue  # the engine's head is the embedding; loading it twice would be wrong
        if name in seen:
            raise RefitError(
                f"snapshot names tensor {name!r} twice (after removing wrapper "
                f"prefixes {WRAPPER_PREFIXES}); the learner's index is malformed"
            )
        seen.add(name)
        out.append((e, name))
    if expected is not None:
        want = {n for n in expected if not (tied and n == TIED_HEAD)}
        missing, extra = sorted(want - seen), sorted(seen - want)
        if missing or extra:
            raise RefitError(
                f"snapshot does not fit the engine's model: missing {missing[:3]}, "
                f"unexpected {extra[:3]} ({len(missing)} and {len(extra)} in all); "
                f"worker and learner must use the same model.name"
            )
    return out


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Tensor names of a Hugging Face folder's safetensors files, read from their headers only
    (8-byte length, then JSON), so neither torch nor the weights are loaded."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RefitError(
            f"{folder} has no *.safetensors file: the vLLM backend loads the "
            f"model from a folder written by save_pretrained()"
        )
    from echo_rl.core.models import safetensors_header

    names: set[str] = set()
    for f in files:
        names.update(k for k in safetensors_header(f) if k != "__metadata__")
    return names


def tied_embeddings(model_dir: str | Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(
        cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False))
    )


# ----------------------------------------------------------------------------- layout


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_layout(
    index: list[TensorLayout], tied: bool, expected: set[str] | None = None
) -> tuple[list[Entry], int]:
    """Where each tensor lies in the shared file, and the file's size."""
    entries, offset = [], 0
    for e, name in map_names(index, tied, expected):
        dtype, nbytes = str(e["dtype"]), int(e["nbytes"])
        shape = tuple(int(d) for d in e["shape"])
        if dtype not in ELEMENT_SIZE:
            raise RefitError(f"tensor {name}: dtype {dtype!r} is not one of {sorted(ELEMENT_SIZE)}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * ELEMENT_SIZE[dtype] != nbytes:
            raise RefitError(
                f"tensor {name}: shape {list(shape)} in {dtype} is "
                f"{numel * ELEMENT_SIZE[dtype]} bytes, the index says {nbytes}"
            )
        entries.append(Entry(name, dtype, shape, offset, nbytes, int(e["offset"])))
        offset = aligned(offset + nbytes)
    return entries, offset


def shared_dir() -> Path:
    """``/dev/shm`` where it exists (memory, no disk write), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def write_shared(
    entries: list[Entry],
    size: int,
    payload: bytes | bytearray | memoryview,
    folder: Path | None = None,
    tag: str = "",
) -> Path:
    """The payload's tensors copied to a new file at their aligned offsets. The caller unlinks
    it after the engine has loaded it."""
    buf = memoryview(payload)
    fd, name = tempfile.mkstemp(
        prefix=f"echo-refit-{tag}", suffix=".bin", dir=folder or shared_dir()
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.truncate(size)
            for e in entries:
                src = buf[e.src_offset : e.src_offset + e.nbytes]
                if len(src) != e.nbytes:
                    raise RefitError(
                        f"tensor {e.name}: payload ends at {len(buf)} bytes, the "
                        f"index puts it at {e.src_offset}+{e.nbytes}"
                    )
                fh.seek(e.offset)
                fh.write(src)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


# ----------------------------------------------------------------------------- versions


class VersionBook:
    """Which weights generate: one lock between generation and installs.

    ``dispatch()`` holds the lock for a generation call and yields the version it runs under;
    ``installing(v)`` holds it for an install. So an install waits for the generation in
    flight, which finishes on the weights it started with (policy "finish"): nothing is
    resubmitted, and every token of a call comes from the version ``dispatch`` yielded.
    """

    policy = "finish"

    def __init__(self) -> None:
        self.version = -1
        self.installs = 0
        self.install_wait_s = 0.0  # total time installs waited for generation in flight
        self.install_s = 0.0  # total time spent loading weights
        self._lock = threading.Lock()

    @contextmanager
    def dispatch(self) -> Iterator[int]:
        with self._lock:
            if self.version < 0:
                raise RefitError(
                    "no snapshot installed yet: the worker generates only after "
                    "its first verified install"
                )
            yield self.version

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Holds generation off while the engine sleeps or wakes: no install is counted."""
        with self._lock:
            yield

    @contextmanager
    def installing(self, version: int) -> Iterator[None]:
        t0 = time.monotonic()
        with self._lock:
            t1 = time.monotonic()
            self.install_wait_s += t1 - t0
            # No ordering check: a worker that re-joins another run starts over at lower
            # versions, and the agent already installs only what is newer for its run.
            yield
            self.version = version
            self.installs += 1
            self.install_s += time.monotonic() - t1
