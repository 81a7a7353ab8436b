"""Files that hold a secret (the API token, ``file:`` secrets): read with their mode.

A module of its own, free of pydantic, so that ``wsync status --token-file`` checks the
file as the daemon does without paying the config's start-up time.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def too_open(path: Path, st: os.stat_result) -> str | None:
    """Why a file holding a secret is open to more users than it should be, or None.

    Other users may do nothing with it (``o`` bits), and its group may not write it
    (whoever writes it chooses the token).  Its group may read it: that is how the
    documented systemd setup lets the ``wsync`` user read a root-owned token
    (``umask 027``, ``chgrp wsync``: mode 0640), so refusing it would refuse that
    setup; ``chmod 600`` (owned by the daemon's user) is stricter still.
    """
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007 or mode & 0o020:
        who = "other users" if mode & 0o007 else "its group"
        return (
            f"{path} can be read or written by {who} (mode {mode:04o}); chmod 600 {path} "
            "(or 640, owned by root with the daemon's group, as in systemd/wsync.service; "
            "a Kubernetes Secret volume: defaultMode 0440 with the pod's fsGroup, as in "
            "deploy/k8s-pod.yaml)"
        )
    return None


def read_secret_file(path: Path) -> tuple[str, str | None]:
    """The text of a file holding a secret, and :func:`too_open`'s finding about it.

    The mode is read from the file as opened (``fstat``), so it is the mode of the
    very file read, not of one swapped in between.  Raises OSError as reading does.
    """
    with open(path, encoding="utf-8") as fh:
        finding = too_open(path, os.fstat(fh.fileno()))
        return fh.read(), finding
