"""File modes for what the package writes (programs, records, checkpoints)."""

from __future__ import annotations

import os


def umask_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the process's umask
    (``0o666 & ~umask``): ``tempfile.mkstemp`` creates 0600, and a file renamed into place
    from it should be readable by whoever the user's umask lets read their files."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
