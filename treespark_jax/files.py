"""Atomic file writes and output locks: a file under its final name is always complete.

Every file the library writes for later reading (asset downloads and their sidecars, cost
profiles, rollout manifests, training run identities and metric logs, prompt files) is first
written to a hidden ``.<name>.<random>.partial`` file in the same directory, flushed to disk and
then renamed over the final name with ``os.replace`` (atomic on POSIX and Windows within one
file system); a directory (a drafter checkpoint or export) likewise, by ``write_dir_atomic``. A crash or an exception leaves either the old file or the new one, never half of
one, and the partial file is removed on an exception. New files get the usual mode (``0o666``
less the process umask), unlike ``tempfile.mkstemp``'s ``0o600``.

A process killed outright (``kill -9``) cannot remove its partial file. Whoever next holds the
output's lock (``hold_lock``: an advisory ``filelock`` lock, so one writer per output at a time)
removes the leftovers with ``remove_partials``; without the lock a partial file may be another
process's write in progress.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import filelock

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
LOCK_NAME = ".treespark.lock"  # the lock file inside a locked output directory


_CHUNK = 1 << 20  # bytes per read while hashing


def sha256_files(paths: Iterable[str | Path]) -> str:
    """Lowercase hex sha256 of the concatenated bytes of ``paths``, in the order given, streamed
    in 1 MiB chunks (one path: that file's sha256).

    Raises:
      OSError: a path that cannot be read.
    """
    hasher = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
    return hasher.hexdigest()


def create_partial(path: Path) -> tuple[int, Path]:
    """Creates a new, empty hidden ``.<name>.<random>.partial`` file next to ``path``.

    Returns:
      ``(fd, partial_path)``: a file descriptor open for writing and the file's path.

    Raises:
      OSError: when the directory does not exist or is not writable.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Writes ``text`` (UTF-8) to ``path`` atomically, replacing any file there.

    Returns:
      ``path`` as a ``Path``.

    Raises:
      OSError: when the directory does not exist or is not writable (nothing is left behind).
    """
    path = Path(path)
    fd, tmp = create_partial(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _lock(path: Path, timeout: float) -> Callable[[], None] | None:
    """Takes the ``filelock`` lock ``path`` within ``timeout`` seconds (``-1``: wait); returns its
    release, ``None`` when another process holds it, or a no-op release (with a logged warning)
    on a file system without locks (some network mounts), where writers are not kept apart."""
    lock = filelock.FileLock(path)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        return None
    except (NotImplementedError, OSError) as e:
        logger.warning("cannot lock %s (%s); going on without keeping other writers out.", path, e)
        return lambda: None
    return lock.release


def hold_lock(directory: Path, what: str) -> Callable[[], None]:
    """Takes the exclusive lock of an output directory (``LOCK_NAME`` inside it), without waiting.

    The operating system drops the lock when the process ends, even after ``kill -9``; the lock
    file itself stays (empty).

    Args:
      directory: an existing directory.
      what: how an error names it, e.g. ``"rollout directory"``.

    Returns:
      The function that releases the lock.

    Raises:
      ValueError: another process holds the lock (one sentence naming the directory).
    """
    return _hold(directory / LOCK_NAME, f"{what} {str(directory)!r}", "directory")


def hold_file_lock(path: Path, what: str) -> Callable[[], None]:
    """Takes the exclusive lock of an output file (the hidden ``.<name>.lock`` beside it), without waiting.

    As ``hold_lock``, for a file that grows over several runs (a resumable log);
    ``remove_locked_file`` removes both once the file is no longer needed.

    Args:
      path: the file (its folder must exist).
      what: how an error names it, e.g. ``"progress file"``.

    Returns:
      The function that releases the lock.

    Raises:
      ValueError: another process holds the lock (one sentence naming the file).
    """
    return _hold(_file_lock(path), f"{what} {str(path)!r}", "file")


def remove_locked_file(path: Path) -> None:
    """Removes a file kept under ``hold_file_lock`` and its lock file, once no run needs it (call it
    after releasing the lock; a missing file is no error)."""
    path.unlink(missing_ok=True)
    _file_lock(path).unlink(missing_ok=True)


def _file_lock(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _hold(lock: Path, named: str, kind: str) -> Callable[[], None]:
    release = _lock(lock, timeout=0)
    if release is None:
        raise ValueError(f"{named} is being written by another treespark process; wait for it to finish or "
                         f"choose another {kind}.")
    return release


def wait_for_lock(path: Path) -> Callable[[], None]:
    """Takes the lock file ``path``, waiting while another process holds it.

    Returns:
      The function that releases the lock.
    """
    return _lock(path, timeout=-1)


def remove_partials(directory: Path, name: str | None = None) -> list[Path]:
    """Removes the partial files (or directories) left in ``directory`` by killed writers: those
    of ``name`` (``.<name>.*.partial``), or every ``.*.partial`` entry. Call it only while holding
    the lock that makes this process the directory's (or the name's) only writer.

    Returns:
      The paths removed.
    """
    pattern = f".{name}.*{PARTIAL_SUFFIX}" if name else f".*{PARTIAL_SUFFIX}"
    removed = sorted(directory.glob(pattern))
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return removed


def write_dir_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Makes the directory ``path`` whole or not at all: ``write(tmp)`` fills a hidden sibling
    (``.<name>.<random>.partial``, same file system), which is then renamed into place. An existing
    ``path`` is swapped out only once the new directory is complete, then removed; a failed
    ``write`` leaves ``path`` as it was and no sibling behind.

    Returns:
      ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.parent / f".{path.name}.{secrets.token_hex(4)}"
    tmp, old = stem.with_name(stem.name + PARTIAL_SUFFIX), stem.with_name(stem.name + ".old")
    try:
        tmp.mkdir()
        write(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    return path
