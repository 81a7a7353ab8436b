"""What a pull checks of DEST before it writes anything: that it would lose nothing, loop
into itself or run into wsync's own state, and that no other pull holds it.

A pull replaces DEST whole, so every refusal here is a file the user keeps: DEST inside the
source workspace (or around it), over the state directory, a symlink, a non-directory, a
mount point, or a non-empty directory wsync did not write (unless ``--force``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from wsync.engine.api import PullOptions
from wsync.engine.destdir import DestDir
from wsync.engine.fsutil import overlaps
from wsync.engine.journal import DestRegistry
from wsync.errors import UsageError
from wsync.transports.base import Transport


def check_dest(dest: Path, transport: Transport, workspace: str, options: PullOptions) -> DestDir:
    """Refuse destinations that would lose data or loop; open and lock DEST's parent.

    The returned :class:`DestDir` holds DEST's parent open (reached from
    ``options.dest_root`` without symlinks when that is set) and the DEST
    lock; every write of the pull goes through it.  The caller closes it.
    """
    target = DestDir.open(Path(dest), options.dest_root)
    try:
        real = target.path
        inner = getattr(transport, "inner", transport)
        if inner.scheme == "local":
            source = Path(os.path.expanduser(workspace)).resolve()
            if real == source or source in real.parents:
                raise UsageError(f"DEST {dest} is inside the source workspace {source}")
            if real in source.parents:
                raise UsageError(f"the source workspace {source} is inside DEST {dest}")
        state = Path(options.state_dir).resolve()
        if overlaps(real, state):
            # the swap would put the guest's tree over the journal, or move it away
            raise UsageError(
                f"DEST {dest} and wsync's state directory {state} (--state-dir) overlap; "
                "a pull replaces DEST whole"
            )
        registry = DestRegistry(options.state_dir)
        # for the whole pull: a second pull into DEST, or into a DEST inside it or around
        # it, fails here, at once
        target.lock(registry.owns)
        st = target.stat()
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UsageError(f"DEST is a symlink; name the directory itself: {dest}")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"DEST exists and is not a directory: {dest}")
        if st is not None:
            target.check_not_mount(st)
            if not options.force and not registry.owns(real):
                # accepted as empty: it must still be at the swap (see DestDir.empty)
                target.empty = True
            if target.empty and not target.is_empty():
                raise UsageError(
                    f"DEST {dest} is a non-empty directory that wsync did not write (or "
                    f"not with this --state-dir, {options.state_dir}); it would be replaced "
                    "entirely (pass --force to allow this)"
                )
    except BaseException:
        target.close()
        raise
    return target
