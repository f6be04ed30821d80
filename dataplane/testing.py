"""Test helpers for adapter authors: a Qwen-style (ChatML) character tokenizer built in memory.

The tiny quickstart tokenizer (``echo.models.build_tiny_tokenizer``) only knows digits,
``+-*=`` and ``a-f``; adapters whose data is ordinary text (math word problems, poker
observations) need a tokenizer that can encode it. This one maps every printable ASCII
character to one token, has ``<|im_start|>`` / ``<|im_end|>`` specials and a ChatML chat
template shaped like Qwen's, and needs no download, so tests and examples can exercise the
real multi-turn code paths (turn-start tokens, end-of-turn tokens, role headers).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this module does not import transformers
    from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def build_chatml_char_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII, one token per character, ChatML specials; eos = ``<|im_end|>``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    vocab = {t: i for i, t in enumerate(CHATML_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def write_entry_points(
    site: str | Path, dist_name: str, adapters: dict[str, str], group: str = "echo.adapters"
) -> Path:
    """Make ``site`` look like an installed distribution ``dist_name`` that declares
    ``adapters`` (``{"name": "module:Class"}``) in ``group``.

    Put ``site`` on ``sys.path`` (or ``PYTHONPATH`` for child processes) and
    ``load_adapter(name, ...)`` finds them, exactly as after a ``pip install``; this is how to
    test an adapter's registration without building a wheel.
    """
    site = Path(site)
    info = site / f"{dist_name.replace('-', '_')}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.0.0\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in adapters.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info
