"""Load a target (config, weights, tokenizer) from a preset name, a GGUF file or an HF directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.config import ModelConfig
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.load_gguf import open_gguf, read_gguf
from treespark_jax.models.load_hf import load_hf_config, load_hf_weights
from treespark_jax.models.presets import resolve_target
from treespark_jax.models.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


@dataclasses.dataclass
class Target:
    """A loaded target model.

    Attributes:
      name: the preset name or the path it was loaded from (recorded in drafter checkpoints).
      path: the checkpoint file or directory.
      cfg: architecture read from the checkpoint.
      model: the NNX decoder.
      tokenizer: tokenizer and chat template of the checkpoint; ``None`` for a bare model made in
        code (profiling a random target), which can decode token ids but not text.
    """

    name: str
    path: Path
    cfg: ModelConfig
    model: Decoder
    tokenizer: Tokenizer | None


def load_target(preset_or_path: str, dtype: str = "float32") -> Target:
    """Loads a target offline.

    Args:
      preset_or_path: a preset name (fetched into the cache and sha256-checked on first use),
        a ``.gguf`` file, or a Hugging Face directory with ``config.json`` and ``*.safetensors``.
      dtype: compute dtype name: ``float32`` (CPU default), ``bfloat16`` (GPU/TPU) or ``float64``.

    Raises:
      ValueError: unknown preset, missing path, unknown dtype, or a checkpoint that does not
        match its config (each a one-sentence message naming the value).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}.")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)  # else JAX silently truncates to float32
    path = resolve_target(preset_or_path)
    np_dtype = np.float64 if dtype == "float64" else np.float32
    if path.is_dir():
        cfg = load_hf_config(path)
        weights = load_hf_weights(path, cfg, np_dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        reader = open_gguf(path)
        cfg, weights, _ = read_gguf(path, np_dtype, reader)
        tokenizer = Tokenizer.from_gguf(reader)
    model = Decoder(cfg, weights, DTYPES[dtype])
    return Target(name=preset_or_path, path=path, cfg=cfg, model=model, tokenizer=tokenizer)
