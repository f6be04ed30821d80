"""What a generation backend must do: install snapshot payloads and sample groups."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from echo import wire


@dataclass
class Sample:
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each completion token under the sampler


class Backend(ABC):
    tokenizer: Any
    vocab_size: int

    @abstractmethod
    def install(self, tensors: list[dict[str, Any]], payload: bytes | bytearray,
                version: int = -1) -> None:
        """Load a verified snapshot's full payload; ``version`` is the snapshot's version."""

    @abstractmethod
    def generate(self, groups: list[wire.Group], max_new_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        """``group.n`` samples for each group, under the installed weights."""
