"""Files of the SSD tier that another process removed (`mlxq cache prune` beside a running server).

The server indexes its directory at start-up and then trusts the index. A prune under it removes
files the index still lists, so a flush or the shutdown line would count them as durable. At each
flush the index is checked against the directory (one stat per file: flushes are rare) and what
vanished is forgotten; it is not written again, since removing it was the operator's choice.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("mlxq.ssd")


def forget_vanished(index: dict[Path, object]) -> int:
    """Drop the entries of ``index`` (file path -> entry) whose file is gone; how many went."""
    gone = [path for path in list(index) if not path.exists()]
    for path in gone:
        index.pop(path, None)
    if gone:
        log.info("SSD cache: %d files were removed by another process (mlxq cache prune?); no longer counted",
                 len(gone))
    return len(gone)
