"""Whether a file may be trusted as this user's own: what stalwart reads and then acts on
(a signing key, a pickle that runs code when loaded) must be a file no one else can change.
"""

from __future__ import annotations

import os
import stat


def why_not_own(st: os.stat_result) -> str | None:
    """Why a file with these stats is not this user's alone (None when it is): it must be
    owned by this user or root, and writable by neither its group nor others."""
    if st.st_uid not in (os.getuid(), 0):
        return (f"it is owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root: "
                f"whoever owns it can change it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"it is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"chmod go-w it")
    return None
