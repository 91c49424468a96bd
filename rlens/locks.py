"""Exclusive locks on folders between processes: an ``flock`` on a lock file that names its holder's pid.

The kernel releases the lock when its holder exits, crashed or not, so a stale lock file never blocks anyone.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO


class LockedError(RuntimeError):
    """Another process (or another holder in this one) has the lock; the message names it."""


def acquire(path: Path, what: str) -> TextIO:
    """Take the lock at ``path`` or raise :class:`LockedError` saying ``what`` is in use and by which pid. Keep the
    returned handle open as long as the lock is needed; :func:`release` (or the process's exit) gives it back."""
    handle = Path(path).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise LockedError(f"{what} is in use by {holder}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def release(handle: TextIO | None) -> None:
    if handle is not None and not handle.closed:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def holder(path: Path, what: str) -> str | None:
    """Who holds the lock at ``path`` (the :class:`LockedError` message), or None when it is free."""
    if not Path(path).parent.is_dir():
        return None
    try:
        release(acquire(path, what))
    except LockedError as exc:
        return str(exc)
    return None
