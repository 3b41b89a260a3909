"""What the SSD tier counts and reports: its files' and the cold tier's counters, a flush's answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ColdTierCounters:
    spills: int = 0  # dirty entries evicted from RAM and queued for disk
    demotions: int = 0  # idle RAM entries released because they are on disk
    dropped: int = 0  # spills dropped over the queue cap (their prefixes are lost)
    failed: int = 0  # writes the disk refused
    restores_skipped_slower: int = 0  # hits not restored: recomputing was predicted faster
    restores_joined: int = 0  # restores that waited for another's read of a shared prefix and built on it
    restores_ranks_apart: int = 0  # tensor parallel: not restored, as a rank lacked the entry or failed to read it


# Rates are smoothed over recent observations (exponential moving average).
RATE_SMOOTHING = 0.5
# A prefill this short says little about the machine's prefill rate.
MIN_PREFILL_SAMPLE_TOKENS = 512


@dataclass(frozen=True)
class FlushResult:
    durable: bool
    pending: int  # entries still not on disk
    dropped: int  # spills dropped since the last flush
    failed: int  # writes that failed during this flush
    entries: int  # node files in the SSD tier
    longest_durable_prefix_tokens: int
    elapsed_s: float = 0.0
    timed_out: bool = False
    checkpoints: dict | None = None  # generation checkpoints' part (store.checkpoints.CheckpointFlush), when on

    def as_dict(self) -> dict:
        return asdict(self)


def smooth(old: float | None, new: float) -> float:
    return new if old is None else RATE_SMOOTHING * new + (1 - RATE_SMOOTHING) * old


@dataclass
class SsdStats:
    restores: int = 0
    restored_tokens: int = 0
    restore_ms_last: float = 0.0
    restore_verify_wait_ms_last: float = 0.0  # of restore_ms_last: waiting for checksums after the last layer loaded
    read_files: int = 0  # node files read by restores (a prefix shared by many restores counts once)
    read_bytes: int = 0
    reread_bytes: int = 0  # bytes of files read again (evicted from RAM, or only partly used the first time)
    writes: int = 0  # node files written
    written_bytes: int = 0
    write_failures: int = 0
    corrupt_removed: int = 0  # files unlinked at scan or restore because they failed a check
    orphans_removed: int = 0  # files unlinked because a file above them was missing or bad
    old_format_removed: int = 0  # files of another format version, removed at scan
    unfinished_splits_removed: int = 0  # heads of splits a crash cut short (the whole file stays)
    evicted_files: int = 0  # removed to stay under the byte cap
    reaped_tmp: int = 0
