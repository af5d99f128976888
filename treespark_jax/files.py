"""Atomic file writes: a file under its final name is always complete.

Every file the library writes for later reading (asset downloads and their sidecars, cost
profiles, rollout manifests, training run identities and metric logs, prompt files) is first
written to a hidden ``.<name>.<random>.partial`` file in the same directory, flushed to disk and
then renamed over the final name with ``os.replace`` (atomic on POSIX and Windows within one
file system). A crash or an exception leaves either the old file or the new one, never half of
one, and the partial file is removed on an exception. New files get the usual mode (``0o666``
less the process umask), unlike ``tempfile.mkstemp``'s ``0o600``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


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
