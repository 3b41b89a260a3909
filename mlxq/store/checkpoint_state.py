"""The checkpoint store's plain state: its counters, a writer job, a flush's answer, chain reachability."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mlxq.store.checkpoint_links import CheckpointRecord


@dataclass
class CheckpointCounters:
    written: int = 0  # link files renamed into place
    written_bytes: int = 0  # their tensors' bytes: the KV copied off the device (files add headers, alignment)
    restored: int = 0  # requests resumed from a checkpoint
    restored_tokens: int = 0  # completion tokens those resumes did not generate again
    dropped: int = 0  # publishes not written: queue over its cap, the disk refused, or their parent was gone
    superseded: int = 0  # links removed because a newer chain of their request became durable
    deleted: int = 0  # checkpoints (whole chains) removed because their request completed
    corrupt_removed: int = 0  # links unlinked at scan or restore because they (or a link below them) failed
    kernel_links: int = 0  # batch links whose copy the one-pass CUDA kernel made (engine/checkpoint_spans.py)


@dataclass
class LinkJob:
    key: str
    layers: list | None  # None: remove the key's chain
    start: int = 0  # the link's span: tokens [start, end)
    end: int = 0
    header: dict = field(default_factory=dict)
    nbytes: int = 0
    record: CheckpointRecord | None = None


@dataclass(frozen=True)
class CheckpointFlush:
    """A flush's answer for checkpoints: durable when everything published before it is on disk."""

    durable: bool
    pending: int  # publishes still queued or being written
    dropped: int  # publishes dropped since the last flush
    requests: int  # requests with a checkpoint on disk
    files: int  # their link files

    def as_dict(self) -> dict:
        return asdict(self)



def reaches_first(links: dict[int, int], end: int) -> bool:
    """Whether the link ending at ``end`` chains down to a first link (``links``: end -> start)."""
    seen = set()
    while end in links and end not in seen:
        seen.add(end)
        end = links[end]
        if end == 0:
            return True
    return False


def newest_chain(links: dict[int, int], jobs: list[LinkJob]) -> list:
    """The chain ending at the newest link, first link first: a queued ``LinkJob`` where one is (it is
    newer than a file of the same end), else (start, end) of a durable file (``links``: end -> start).
    Empty when a link on the way down is missing (dropped or removed)."""
    known: dict[int, object] = {end: (start, end) for end, start in links.items()}
    known.update({job.end: job for job in jobs})
    chain, end = [], max(known, default=0)
    while end:
        item = known.get(end)
        if item is None:
            return []
        chain.append(item)
        end = item.start if isinstance(item, LinkJob) else item[0]
    return chain[::-1]
