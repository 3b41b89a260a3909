"""The process's open-file limit, as it was before mlx-lm changed it.

Importing ``mlx_lm`` sets ``RLIMIT_NOFILE`` to (2048, 4096), lowering it on a
Linux box configured for more, and each open connection holds a descriptor:
2,048 half-sent requests then lock every other client out. ``mlxq``
records the limit when it is imported (before anything imports mlx-lm), and
the server calls ``restore`` once its imports are done.
"""

from __future__ import annotations

import resource

MAX_SOFT = 1 << 16  # enough descriptors for any connection cap we set; "unlimited" is refused on Linux
ORIGINAL = resource.getrlimit(resource.RLIMIT_NOFILE)


def restore() -> int:
    """Put back the original hard limit and raise the soft limit to it (at most ``MAX_SOFT``); the soft limit."""
    original_hard = ORIGINAL[1]
    hard_cap = MAX_SOFT if original_hard == resource.RLIM_INFINITY else original_hard
    soft = max(ORIGINAL[0] if ORIGINAL[0] != resource.RLIM_INFINITY else MAX_SOFT, min(hard_cap, MAX_SOFT))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, original_hard))
    except (ValueError, OSError):  # the hard limit was lowered and we may not raise it: go up to what is left
        current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = min(soft, current_hard if current_hard != resource.RLIM_INFINITY else MAX_SOFT)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, current_hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
