"""Architecture-only model configurations shipped in ``reproduce/models/`` and their preparation.

A model here is a directory holding a Hugging Face ``config.json`` and no weights; vLLM serves it
with ``--load-format dummy`` (random weights, real compute). ``prepare_model_dir`` copies the
config into a working directory and writes beside it a word-level tokenizer built offline
(``t0`` .. ``t{vocab-1}``, one word per token id). With a tokenizer present vLLM answers an
out-of-vocabulary token id with a clean HTTP 400 instead of killing its worker, which it does
under ``--skip-tokenizer-init``; the tokenizer is also what lets text prompts through.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MODELS_DIR",
    "ModelConfigError",
    "ModelInfo",
    "list_models",
    "model_info",
    "prepare_model_dir",
    "resolve_model",
    "write_tokenizer",
]

#: The shipped configurations: ``tiny`` (fast tests), ``small`` (the real-vLLM pulse runs: Ĉ of a
#: few calls/s on a 2-core CPU), ``heavy`` (realistic CPU prefill) and the study's three GPU models.
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelConfigError(ValueError):
    """A model directory or name that cannot be served; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a backend needs to know about a model without loading it."""

    name: str
    path: Path
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of KV cache one token takes: 2 (K and V) x layers x KV heads x head dim x dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def list_models() -> list[str]:
    """Names of the shipped configurations."""
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json"))


def resolve_model(name_or_path: str | Path) -> Path:
    """A shipped configuration's directory by name, or a directory holding a ``config.json``."""
    candidate = Path(name_or_path)
    if (candidate / "config.json").is_file():
        return candidate.resolve()
    shipped = MODELS_DIR / str(name_or_path)
    if (shipped / "config.json").is_file():
        return shipped
    raise ModelConfigError(
        f"no model configuration {str(name_or_path)!r}: give a directory with a config.json "
        f"or one of {', '.join(list_models())}"
    )


def _load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path / 'config.json'}: not a readable JSON config ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path / 'config.json'}: expected a JSON object")
    return config


def model_info(name_or_path: str | Path) -> ModelInfo:
    """Read the architecture of a shipped name or a model directory."""
    path = resolve_model(name_or_path)
    config = _load_config(path)
    try:
        vocab = int(config["vocab_size"])
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"{path / 'config.json'}: missing or bad field ({exc})") from exc
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if vocab < 2 or layers < 1 or hidden < 1 or heads < 1:
        raise ModelConfigError(f"{path / 'config.json'}: sizes must be positive (vocab >= 2)")
    return ModelInfo(
        name=path.name,
        path=path,
        vocab_size=vocab,
        num_layers=layers,
        hidden_size=hidden,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(config.get("max_position_embeddings") or 0),
    )


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a word-level tokenizer with one word ``t<i>`` per token id ``i`` into ``directory``.

    The JSON is what the ``tokenizers`` package saves for such a tokenizer, written directly so
    the project needs no tokenizer dependency. Ids 1 and 2 are BOS and EOS, 0 is unknown.
    """
    if vocab_size < 3:
        raise ModelConfigError(f"vocab_size must be >= 3 for a tokenizer, got {vocab_size}")
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        # WordPiece's decoder joins words with spaces (there is no "##" continuation here).
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)}, "unk_token": "t0"},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "t0",
        "bos_token": "t1",
        "eos_token": "t2",
        "model_max_length": 1_000_000,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, separators=(",", ":")), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def prepare_model_dir(name_or_path: str | Path, workdir: Path) -> ModelInfo:
    """Copy a configuration into ``workdir/<name>`` with an offline tokenizer; return its info.

    A directory that already holds a tokenizer is copied as is. The shipped tree is never written.
    """
    info = model_info(name_or_path)
    target = workdir / info.name
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(info.path / "config.json", target / "config.json")
    if all((info.path / f).is_file() for f in _TOKENIZER_FILES):
        for f in _TOKENIZER_FILES:
            shutil.copyfile(info.path / f, target / f)
    elif not all((target / f).is_file() for f in _TOKENIZER_FILES):
        write_tokenizer(target, info.vocab_size)
    return model_info(target)
