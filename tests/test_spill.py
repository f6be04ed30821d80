"""echo_rl.core.spill: payloads kept in unlinked files, read through read-only maps (docs/memory.md)."""

from __future__ import annotations

import mmap
import os

import blake3
import pytest
import torch

from echo_rl.broadcast.manifest import ChunkLayout
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.core.models import params_to_payload, params_to_spill
from echo_rl.core.spill import drop_pages, spill, spill_dir


def test_a_spilled_payload_reads_as_the_bytes_and_leaves_no_file(tmp_path):
    data = os.urandom(3 << 20)
    m = spill(data, tmp_path)
    assert isinstance(m, mmap.mmap) and len(m) == len(data)
    assert blake3.blake3(m).digest() == blake3.blake3(data).digest()
    assert memoryview(m)[1000:1010].tobytes() == data[1000:1010]
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing outlives the process
    drop_pages(m)  # done reading for now: the bytes are still there
    assert m[:16] == data[:16]
    with pytest.raises(TypeError):
        m[0] = 1  # read-only: no holder can change a published version under another


def test_params_written_to_a_spill_match_the_in_memory_payload(tmp_path):
    torch.manual_seed(0)
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7)), ("c", torch.zeros(0))]
    index, payload = params_to_payload(named, "bfloat16")
    sindex, spilled = params_to_spill(named, "bfloat16", tmp_path)
    assert sindex == index and bytes(spilled) == payload
    buf = SnapshotBuffer(ChunkLayout(3, len(payload), 16, (b"",) * -(-len(payload) // 16)), spilled)
    assert bytes(buf.chunk(1)) == payload[16:32]  # chunks are served as slices of the map
    # stochastic rounding (broadcast.rounding) sends the same bytes either way
    _, sto = params_to_payload(named, "bfloat16", seed=5)
    _, sto_spilled = params_to_spill(named, "bfloat16", tmp_path, seed=5)
    assert bytes(sto_spilled) == sto and sto != payload


def test_the_spill_directory_is_never_tmp_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("ECHO_SPILL_DIR", raising=False)
    monkeypatch.setenv("ECHO_HOME", str(tmp_path / "home"))
    assert spill_dir() == tmp_path / "home" / "spill" and spill_dir().is_dir()
    assert spill_dir(tmp_path / "run" / "spill") == tmp_path / "run" / "spill"


def test_an_empty_payload_needs_no_file(tmp_path):
    assert spill(b"", tmp_path) == b""


def rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


def test_chunks_sent_from_a_spilled_payload_leave_the_resident_set(tmp_path):
    """A learner or relay serving a spilled version reads it chunk by chunk; each chunk's
    pages go once it is sent (SnapshotBuffer.sent), so the file is never resident whole."""
    data = os.urandom(64 << 20)
    chunk = 4 << 20
    buf = SnapshotBuffer(
        ChunkLayout(1, len(data), chunk, (b"",) * (len(data) // chunk)), spill(data, tmp_path)
    )
    before = rss_file()
    for i in range(buf.total):  # read every chunk, as a send does
        assert bytes(buf.chunk(i)[:8]) == data[i * chunk : i * chunk + 8]
        blake3.blake3(buf.chunk(i)).digest()
    touched = rss_file()
    assert touched - before > 48 << 20
    for i in range(buf.total):
        buf.sent(i)
    assert rss_file() - before < 8 << 20
    assert bytes(buf.chunk(3)) == data[3 * chunk : 4 * chunk]  # the bytes are still there
    held = SnapshotBuffer(ChunkLayout(1, 8, 4, (b"", b"")), bytearray(8))
    held.sent(0)  # a payload in RAM: nothing to drop
