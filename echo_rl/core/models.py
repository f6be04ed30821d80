"""Models and tokenizers, one code path for the tiny local model and real checkpoints.

``model.name = "tiny-qwen3"`` builds a Qwen3-architecture model with random weights and a
character-level tokenizer, both in memory (no download): the quickstart and the tests use it.
Any other name is a Hugging Face model directory on local disk, loaded with ``AutoTokenizer``
and ``AutoModelForCausalLM``. Both end up as a ``transformers`` causal LM plus a fast tokenizer,
so everything downstream (generation, snapshots, the loss) is the same code.

Devices: ``resolve_device`` turns a config's ``auto``/``cpu``/``cuda``/``cuda:N`` into a torch
device (under torchrun ``cuda`` means ``cuda:LOCAL_RANK``); ``bf16_compute`` says whether that
device computes in bfloat16 (a GPU that supports it) or stays float32 (the CPU).

Weights travel as snapshots (``broadcast``); this module turns parameters into one byte payload
with a tensor index, and back (the payload is always built in host memory).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.core.config import ModelConfig
from echo_rl.core.errors import EchoError
from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.layout import Payload, TensorLayout

if TYPE_CHECKING:  # torch and transformers load late: entry points must start instantly
    import mmap

    import torch
    from transformers import PreTrainedTokenizerBase, Qwen3Config

TINY = "tiny-qwen3"
# Digits and arithmetic first: the toy tasks use them; letters keep room for small words.
TINY_CHARS = list("0123456789+-*=") + list("abcdef")
# model.tiny_vocab = "text": the same ids first (so "arith" checkpoints' ids keep their meaning),
# then what ordinary English text needs: the rest of printable ASCII, space and newline.
TINY_TEXT_CHARS = TINY_CHARS + [c for c in " \n" + string.printable.strip() if c not in TINY_CHARS]
TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# Roles as one letter each that the "arith" vocabulary can spell (assistant a, user b, system
# c, anything else d): the first letter of "user" or "system" was an <unk> token.
TINY_CHAT_TEMPLATE = (
    "{% set r = {'assistant': 'a', 'user': 'b', 'system': 'c'} %}"
    "{% for m in messages %}<bos>{{ r.get(m['role'], 'd') }}={{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<bos>a={% endif %}"
)


class ModelError(EchoError, ValueError):
    default_reason = "model"


def build_tiny_tokenizer(vocab_kind: str = "arith") -> PreTrainedTokenizerBase:
    """A character tokenizer built here (no download). ``arith`` (the default, 24 tokens):
    digits, ``+-*=`` and ``a-f``, what the toy tasks need (a small vocabulary learns fast);
    ``text``: also every printable ASCII character, space and newline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {"arith": TINY_CHARS, "text": TINY_TEXT_CHARS}[vocab_kind]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _model_dir(cfg: ModelConfig) -> Path:
    path = Path(cfg.name).expanduser()
    if not path.is_dir():
        raise ModelError(
            f'model.name = {cfg.name!r}: no such directory. Use "{TINY}" for the built-in tiny '
            f"model, or the path of a Hugging Face model folder on this machine (downloads are "
            f"not attempted)"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model.name = {cfg.name!r}: {path}/config.json is missing; point "
            f"model.name at a folder written by save_pretrained()"
        )
    return path


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.name == TINY:
        return build_tiny_tokenizer(cfg.tiny_vocab)
    from transformers import AutoTokenizer

    path = _model_dir(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelError(
            f"model.name = {cfg.name!r}: cannot load its tokenizer ({exc}); "
            f"the folder needs tokenizer files saved with save_pretrained()"
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation pads finished rows; EOS is the usual choice
    return tok


def tiny_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def load_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, dtype: str = "float32") -> Any:
    """A causal LM on CPU in ``dtype``: random init (seeded) for tiny, weights from disk else."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    torch_dtype = getattr(torch, dtype)
    if cfg.name == TINY:
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(tiny_config(cfg, tokenizer)).to(torch_dtype)
    else:
        path = _model_dir(cfg)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, local_files_only=True
            )
        except Exception as exc:
            raise ModelError(
                f"model.name = {cfg.name!r}: not a loadable causal LM ({exc})"
            ) from None
    if vocab_size(model) < len(tokenizer):
        raise ModelError(
            f"model.name = {cfg.name!r}: tokenizer has {len(tokenizer)} tokens but "
            f"the model's embedding has {vocab_size(model)}"
        )
    return model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing on every decoder layer, non-reentrant, so that a
    frozen input (a LoRA base) still passes gradients on. transformers 5 renamed the method.
    (Both looked up by name: nn.Module's ``__getattr__`` types any attribute Tensor | Module.)"""
    on = getattr(model, "activation_checkpointing_enable", None)
    if on is not None:
        on(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    old = getattr(model, "gradient_checkpointing_enable", None)
    if old is None:
        raise AttributeError(f"{type(model).__name__} has no gradient_checkpointing_enable")
    old(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_layers(model: torch.nn.Module) -> int:
    """Each decoder layer compiled in place with ``torch.compile`` (regionally, as torchtitan
    does): a narrow model's layer is dozens of small kernels (norms, rotary, SiLU-and-multiply,
    residual adds) that inductor fuses, so a step launches fewer. Parameters and their names
    stay as they are (checkpoints, snapshots, FSDP2 see the same model); the first steps of
    each shape pay the compilation. Returns the number of layers compiled."""
    import torch

    from echo_rl.core.lora import base_of

    decoder = getattr(base_of(model), "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(
            f"learner.compile = true: {type(base_of(model)).__name__} has no decoder layers "
            "where Echo looks for them (model.layers); set learner.compile = false"
        )
    for layer in layers:
        layer.compile()
    return len(layers)


def safetensors_header(path: Path) -> JsonObject:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; ``__metadata__``),
    read alone: 8-byte little-endian length, then JSON. Neither torch nor the weights load."""
    import json
    import struct

    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header: JsonObject = json.loads(fh.read(size))
        return header


def vocab_size_of_folder(folder: str | Path) -> int:
    """The model's vocabulary size from its config.json (the engine holds the weights)."""
    import json

    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])


def engine_model_dir(cfg: ModelConfig, cache_root: str | Path | None = None) -> Path:
    """A folder an inference engine can load (config, safetensors, tokenizer files).

    A real model is its own folder. The tiny model exists only in memory, so it is written once
    (weights from ``cfg.seed``, the same as every other process builds) under ``cache_root``
    (default ``$ECHO_HOME/models`` or ``~/.cache/echo/models``), in a folder named by a hash of
    its config: a changed size or seed gets a new folder, never a stale one.
    """
    if cfg.name != TINY:
        return _model_dir(cfg)
    import hashlib
    import json
    import os

    key = hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
    root = (
        Path(cache_root or os.environ.get("ECHO_HOME", str(Path.home() / ".cache" / "echo")))
        / "models"
    )
    folder = root / f"{TINY}-{key}"
    if (folder / "config.json").is_file():
        return folder
    tok = build_tiny_tokenizer()
    model = load_model(cfg, tok, "float32")
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)  # whole or absent: a crashed write leaves only the .tmp folder
    except OSError:
        if not (folder / "config.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process wrote the same folder first
    return folder


# ----------------------------------------------------------------------------- devices


def resolve_device(
    spec: str, key: str, local_rank: int | None = None, cuda_count: int | None = None
) -> torch.device:
    """The torch device named by ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

    ``key`` is the config key, for the error. ``local_rank`` (torchrun's ``LOCAL_RANK``) makes
    ``auto`` and ``cuda`` pick that rank's GPU, and refuses ``cuda:N``: every rank would take
    the same GPU. ``cuda_count`` stands in for ``torch.cuda.device_count()`` in tests.
    """
    import torch

    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "cpu" or (spec == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if spec not in ("auto", "cuda") and not spec.startswith("cuda:"):
        raise ModelError(f"{key} = {spec!r}: unknown device; use auto, cpu, cuda or cuda:N")
    if cuda_count == 0:
        raise ModelError(
            f"{key} = {spec!r} but no CUDA GPU is visible to torch {torch.__version__}"
            f" (a CPU build, no driver, or CUDA_VISIBLE_DEVICES empty); set {key} = "
            f'"cpu" or "auto"'
        )
    if spec.startswith("cuda:"):
        if local_rank is not None:
            raise ModelError(
                f"{key} = {spec!r} under torchrun: every rank would use the same GPU;"
                f' set {key} = "cuda" (rank r takes cuda:LOCAL_RANK)'
            )
        index = int(spec.split(":", 1)[1])
    else:
        index = local_rank or 0
    if index >= cuda_count:
        raise ModelError(
            f"{key} = {spec!r}: GPU {index} does not exist, this machine shows "
            f"{cuda_count} (cuda:0 to cuda:{cuda_count - 1})"
        )
    return torch.device("cuda", index)


def bf16_compute(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16: a GPU that supports it. The CPU stays float32
    (slow bf16 kernels there, and every existing test runs on float32)."""
    import torch

    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding (``nn.Embedding.num_embeddings``), looked up by
    name: nn.Module's ``__getattr__`` types any attribute Tensor | Module."""
    embeddings = getattr(model, "get_input_embeddings", None)
    rows = None if embeddings is None else getattr(embeddings(), "num_embeddings", None)
    if rows is None:
        raise AttributeError(f"{type(model).__name__} has no input embedding's num_embeddings")
    return int(rows)


# ----------------------------------------------------------------------------- payloads


def cast_weights(p: torch.Tensor, dtype: str, seed: int | None = None) -> torch.Tensor:
    """``p`` in ``dtype``, on its device: rounded to nearest, or (``seed`` given, a float32
    tensor to bfloat16) stochastically: up with probability equal to the fraction of a unit
    it lies above the lower neighbour, so the cast is unbiased (``broadcast.rounding``)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    t = p.detach()
    if seed is None or torch_dtype != torch.bfloat16 or t.dtype != torch.float32:
        return t.to(torch_dtype)
    gen = torch.Generator(device=t.device).manual_seed(seed % (1 << 63))
    bits = t.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, device=t.device, dtype=torch.int32)
    # the 16 bits bf16 drops, plus noise below them, then cut: a carry rounds the magnitude up
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(torch_dtype)


def rounding_seed(run_seed: int, rounding: str, version: int) -> int | None:
    """The seed of version ``version``'s rounding (``broadcast.rounding``), so the snapshot
    workers installed can be rebuilt from the checkpoint (``echo-rl eval --as-sampled``):
    ``stochastic`` draws fresh noise per version (from the run's seed and the version),
    ``dither`` the same noise for every version of the run (each weight keeps one threshold,
    so a publication changes only the weights that crossed theirs); None: to nearest."""
    if rounding == "stochastic":
        return run_seed * 1_000_003 + version
    if rounding == "dither":
        return run_seed * 1_000_003 - 1  # below every version's: no stochastic stream reused
    return None


def params_to_payload(
    named: Iterable[tuple[str, torch.Tensor]], dtype: str, seed: int | None = None
) -> tuple[list[TensorLayout], bytes]:
    """Tensors as one contiguous byte stream in ``dtype`` plus a tensor index.

    Pass ``model.named_parameters()`` (it lists a tied weight once, so tied embeddings travel
    once) or the same names picked from a gathered state dict. ``seed``: stochastic rounding
    (``cast_weights``), one stream per tensor drawn from it; None: to nearest.
    """
    import torch

    index: list[TensorLayout] = []
    parts: list[bytes] = []
    offset = 0
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            # cast on the device (halves the copy for bf16), then to host memory
            s = None if seed is None else seed * 1_000_003 + i
            t = cast_weights(p, dtype, s).contiguous().view(-1).cpu()
            raw = t.view(torch.uint8).numpy().tobytes()
            index.append(
                {
                    "name": name,
                    "dtype": dtype,
                    "shape": list(p.shape),
                    "offset": offset,
                    "nbytes": len(raw),
                }
            )
            parts.append(raw)
            offset += len(raw)
    return index, b"".join(parts)


def params_to_spill(
    named: Iterable[tuple[str, torch.Tensor]], dtype: str, directory: Path, seed: int | None = None
) -> tuple[list[TensorLayout], mmap.mmap | bytes]:
    """``params_to_payload`` written tensor by tensor to a spill file (echo_rl.core.spill) and mapped
    read-only: the payload never exists whole in RAM (docs/memory.md)."""
    import torch

    from echo_rl.core.spill import SpillWriter

    index: list[TensorLayout] = []
    offset = 0
    writer = SpillWriter(directory)
    try:
        with torch.no_grad():
            for i, (name, p) in enumerate(named):
                s = None if seed is None else seed * 1_000_003 + i
                t = cast_weights(p, dtype, s).contiguous().view(-1).cpu()
                raw = t.view(torch.uint8).numpy()
                writer.write(raw.data)
                index.append(
                    {
                        "name": name,
                        "dtype": dtype,
                        "shape": list(p.shape),
                        "offset": offset,
                        "nbytes": int(raw.nbytes),
                    }
                )
                offset += int(raw.nbytes)
    except BaseException:
        writer.close()
        raise
    return index, writer.finish()


def install_payload(model: torch.nn.Module, index: list[TensorLayout], payload: Payload) -> None:
    """Copy a snapshot payload into the model's parameters (shapes and names must match); into
    its LoRA adapter's parameters when ``model`` is a peft model (``echo_rl.core.lora``)."""
    import torch

    from echo_rl.core.lora import adapter_parameters, is_peft
    from echo_rl.core.spill import drop_pages

    params = adapter_parameters(model) if is_peft(model) else dict(model.named_parameters())
    names = {e["name"] for e in index}
    if names != set(params):
        missing, extra = set(params) - names, names - set(params)
        raise ModelError(
            f"snapshot does not fit this model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(extra)[:3]}; worker and learner must use the same "
            f"model.name and the same [learner.lora] settings"
        )
    buf = memoryview(payload)
    with torch.no_grad():
        for e in index:
            raw = buf[e["offset"] : e["offset"] + e["nbytes"]]
            src = torch.frombuffer(bytearray(raw), dtype=getattr(torch, e["dtype"]))
            dst = params[e["name"]]
            if list(dst.shape) != e["shape"]:
                raise ModelError(
                    f"snapshot tensor {e['name']} has shape {e['shape']}, model has "
                    f"{list(dst.shape)}"
                )
            dst.copy_(src.view(e["shape"]).to(dst.dtype))
            # a spilled payload (a map): this tensor's pages leave the resident set as it goes
            drop_pages(payload, e["offset"], e["offset"] + e["nbytes"])
