"""Write files so that readers see either the old content or the complete new one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_directory", "atomic_open", "atomic_write_bytes", "atomic_write_text", "fsync_directory"]


def _umask() -> int:
    # Reading the umask means setting it; doing that once at import keeps the
    # window in which other threads see a borrowed umask as small as possible.
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


# mkstemp creates 0600 files and mkdtemp 0700 directories; results get the
# permissions open() and mkdir() would give.
_FILE_MODE = 0o666 & ~_umask()
_DIR_MODE = 0o777 & ~_umask()


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], mode: str = "wb", encoding: str | None = None
) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success it replaces ``path``.

    The temporary file lives in the same directory so os.replace is a rename
    on one filesystem. If the body raises, the temporary file is removed and
    ``path`` is left untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', not {mode!r}")
    target = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(target))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, _FILE_MODE)
        os.replace(temp, target)
        fsync_directory(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries, so that a rename into it survives a crash (the file's own
    fsync does not cover the name). Filesystems that cannot fsync a directory are left as they are."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # e.g. EINVAL on some network filesystems
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding) as handle:
        handle.write(text)


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a new directory ``dest``: the body fills a temporary sibling, which is renamed
    into place with the permissions mkdir() and open() would give; if the body raises,
    nothing is left. ``dest`` must not exist."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest}: already exists; it is written into a new directory only")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield work
        for entry in os.scandir(work):  # mkdtemp gives 0700, safetensors' writer 0600
            if entry.is_file(follow_symlinks=False):
                os.chmod(entry.path, _FILE_MODE)
        os.chmod(work, _DIR_MODE)
        work.rename(dest)
        fsync_directory(dest.parent)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
