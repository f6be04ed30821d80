"""A local Hugging Face causal LM for evaluation and frozen opponents (no download).

``HFModel(name)``: ``name`` is ``tiny-qwen3`` (random init, for tests), a folder written by
``save_pretrained``, or an Echo run folder (``runs/<id>``: the run's model with the weights of
its latest checkpoint, or with ``untrained=True`` the weights the run started from: the same
seeded init, or the pretrained model); loaded through ``echo_rl.core.models`` like everywhere else, on ``device``
(``cpu`` by default; ``auto``/``cuda``/``cuda:N`` as in ``worker.device``).
``generate(prompts, max_new_tokens, temperature)`` -> ``[(ids, logprobs)]`` (greedy when
``temperature == 0``), cut after the first end-of-sequence, from the tokens in
``answer_tokens`` only when it is set (an adapter's restricted answers); ``chat(messages)`` -> text.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo_rl.core.config import EchoConfig


def run_config(name: str) -> EchoConfig | None:
    """The config of an Echo run folder (``config.toml`` + ``checkpoints/latest``), else None."""
    p = Path(name)
    if (p / "config.toml").is_file() and (p / "checkpoints" / "latest").is_file():
        from echo_rl.core.config import load_config

        return load_config(p / "config.toml")
    return None


class HFModel:
    def __init__(
        self,
        name: str,
        threads: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        untrained: bool = False,
        **model_cfg: object,
    ):
        import torch

        from echo_rl.core.config import ModelConfig
        from echo_rl.core.lora import load_policy_model
        from echo_rl.core.models import bf16_compute, load_tokenizer, resolve_device

        if threads:
            torch.set_num_threads(threads)
        self.run_config = run_config(name)
        if self.run_config is not None:  # an Echo run folder: its model, its latest weights
            cfg = self.run_config.model
        else:
            cfg = ModelConfig(name=name, seed=seed, **model_cfg)
        self.tokenizer = load_tokenizer(cfg)
        self.device = resolve_device(device, "device")
        dtype = "bfloat16" if bf16_compute(self.device) else "float32"
        # a LoRA run's model is its base with the run's adapter (untrained: B = 0, the base)
        lora = self.run_config.learner.lora if self.run_config is not None else None
        self.model = load_policy_model(cfg, lora, self.tokenizer, dtype)[0].eval()
        if untrained and self.run_config is None:
            raise ValueError(
                f"{name}: untrained needs an Echo run folder (config.toml and "
                "checkpoints/); a model folder is untrained already"
            )
        if self.run_config is not None and not untrained:  # untrained: the run's initial weights
            self._load_checkpoint(Path(name))
        self.model.to(self.device)
        self.seed = seed
        self.calls = 0
        # an adapter's restricted answers (echo_rl/data/answers.py): set by whoever knows the
        # adapter (eval, echo-rl sample), so a run is played with the sampler it trained with
        self.answer_tokens: tuple[int, ...] | None = None

    def _load_checkpoint(self, run: Path) -> None:
        """The run's latest weights (a LoRA run's: its adapter, on the base loaded here)."""
        import torch

        from echo_rl.core.lora import adapter_parameters, is_peft

        ckpt = run / "checkpoints"
        state = torch.load(
            ckpt / (ckpt / "latest").read_text().strip(), map_location="cpu", weights_only=False
        )["model"]
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if is_peft(self.model):  # the base is not in the checkpoint: only the adapter must fit
            missing = set(adapter_parameters(self.model)) - set(state)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{run}: checkpoint does not fit the run's model "
                f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
            )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0
    ) -> list[tuple[list[int], list[float]]]:
        import torch
        from transformers import LogitsProcessorList

        from echo_rl.data.answers import answer_processor

        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        sample = temperature > 0
        torch.manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=sample,
                max_new_tokens=max_new_tokens,
                return_dict_in_generate=True,
                output_scores=True,
                pad_token_id=pad,
                eos_token_id=tok.eos_token_id,
                logits_processor=LogitsProcessorList(answer_processor(self.answer_tokens)),
                **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}),
            )
        new = out.sequences[:, width:]
        logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)
        logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        res = []
        for row, lp in zip(new.tolist(), logp.tolist()):
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            res.append((row[:end], [min(0.0, x) for x in lp[:end]]))
        return res

    def chat(
        self, messages: list[dict[str, str]], max_new_tokens: int = 32, temperature: float = 0.0
    ) -> str:
        from echo_rl.data.multiturn import render_ids

        prompt = render_ids(self.tokenizer, messages, add_generation_prompt=True)
        ids, _ = self.generate([prompt], max_new_tokens, temperature)[0]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
