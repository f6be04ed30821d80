"""What holds memory, counted (echo_rl.core.memstat), and a worker that generates in bf16 on request
(worker.dtype; docs/memory.md)."""

from __future__ import annotations

import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.memstat import payload_bytes, resident, tensor_bytes
from echo_rl.core.spill import spill


def test_payloads_are_counted_once_each_in_ram_or_spilled(tmp_path):
    ram, shared = bytearray(1000), b"x" * 300
    spilled = spill(b"y" * 4096, tmp_path)
    got = payload_bytes([ram, shared, shared, spilled, spilled, None])
    assert got == {"ram": 1300, "spilled": 4096}


def test_tensors_sharing_a_storage_are_counted_once():
    a = torch.zeros(100)
    assert tensor_bytes([a, a[10:], a.view(10, 10), torch.zeros(5, dtype=torch.bfloat16)]) == 410


def test_the_resident_set_is_read_from_proc():
    got = resident()
    assert got["rss"] > 0 and got["rss_peak"] >= got["rss"]
    assert got["rss_anon"] + got["rss_file"] <= got["rss"] + 4096 * 16


def test_a_worker_asked_for_bf16_holds_half_the_model_and_still_generates():
    from echo_rl.worker.backends import make_backend

    f32 = make_backend("transformers", model_cfg=ModelConfig(), threads=1)
    bf16 = make_backend("transformers", model_cfg=ModelConfig(), threads=1, dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert tensor_bytes(bf16.model.parameters()) * 2 == tensor_bytes(f32.model.parameters())
    [samples] = bf16.generate(
        [wire.Group(group_id="g", prompt_ids=[4, 14, 5], n=3, seed=1)],
        max_new_tokens=4,
        temperature=1.0,
    )
    assert len(samples) == 3 and all(len(s.completion_ids) == len(s.logprobs) for s in samples)
