"""Atomic writes (``files.py``): whole files under their names, the umask's mode, no leftovers."""

import os
import stat

import pytest

from treespark_jax.files import write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_replaces_the_file_whole_with_the_umask_mode(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    old_umask = os.umask(0o022)
    try:
        assert write_text_atomic(path, "new ✓\n") == path
    finally:
        os.umask(old_umask)
    assert path.read_text(encoding="utf-8") == "new ✓\n"
    assert _mode(path) == 0o644  # 0o666 less the umask, not mkstemp's 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "\ud800")  # a lone surrogate cannot be written as UTF-8
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_missing_directory_is_an_os_error_and_writes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_text_atomic(tmp_path / "absent" / "a.json", "x")
    assert list(tmp_path.iterdir()) == []


def test_the_lock_refuses_a_second_writer_and_partials_go_only_under_it(tmp_path):
    from treespark_jax.files import hold_lock, remove_partials

    (tmp_path / ".a.json.1234.partial").write_text("half")
    (tmp_path / ".drafter.99.partial").mkdir()
    (tmp_path / "a.json").write_text("whole")
    release = hold_lock(tmp_path, "rollout directory")
    with pytest.raises(ValueError, match=r"rollout directory '.*' is being written by another treespark process"):
        hold_lock(tmp_path, "rollout directory")
    assert remove_partials(tmp_path, "a.json") == [tmp_path / ".a.json.1234.partial"]
    assert remove_partials(tmp_path) == [tmp_path / ".drafter.99.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".treespark.lock", "a.json"]
    release()
    hold_lock(tmp_path, "rollout directory")()  # free again


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    import filelock

    from treespark_jax.files import hold_lock, wait_for_lock

    def unsupported(self, *args, **kwargs):
        raise NotImplementedError("FileSystem does not appear to support flock")

    monkeypatch.setattr(filelock.FileLock, "acquire", unsupported)
    with caplog.at_level("WARNING"):
        hold_lock(tmp_path, "rollout directory")()
        wait_for_lock(tmp_path / ".x.lock")()
    assert caplog.text.count("going on without keeping other writers out") == 2
