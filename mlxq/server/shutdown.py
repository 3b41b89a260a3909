"""How `mlxq serve` stops: in-flight requests get --shutdown-timeout to finish, then end properly.

uvicorn's own stop waits for open connections and, at the timeout, cancels
their tasks: a client reading a stream saw a bare connection error and the
log a traceback; a second Ctrl-C forced an exit that also skipped the SSD
flush. Here:

- the first SIGINT/SIGTERM stops accepting and says how long the in-flight
  requests get and how many there are; 1 s before uvicorn would cancel them,
  each open stream gets an error event as its last event (its protocol's
  shape, then the stream's end), so every connection closes cleanly;
- a second Ctrl-C ends them that way at once, then shuts down as usual
  (the SSD tier is still flushed);
- a third is uvicorn's forced exit.

A handled signal ends the process with exit 0: nothing was lost.
"""

from __future__ import annotations

import logging
import threading

import uvicorn

from mlxq.server.bridge import open_streams

log = logging.getLogger("mlxq.server")

# uvicorn cancels tasks at the timeout; streams are ended this much earlier so they finish writing first.
END_STREAMS_EARLY_S = 1.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self._grace_s = grace_s
        self._signals = 0

    def handle_exit(self, sig, frame) -> None:
        self._signals += 1
        if self._signals == 1:
            self._announce()
            deadline = threading.Timer(max(0.0, self._grace_s - END_STREAMS_EARLY_S), self._end_streams,
                                       args=(f"the server is shutting down (--shutdown-timeout {self._grace_s:g} s "
                                             "passed)",))
            deadline.daemon = True
            deadline.start()
            super().handle_exit(sig, frame)
        elif self._signals == 2:
            self._end_streams("the server is shutting down")
        else:
            super().handle_exit(sig, frame)  # uvicorn's forced exit
        # uvicorn re-raises a captured signal after its shutdown, so the process would die
        # "by signal" although nothing was lost: an orderly stop is a success.
        self._captured_signals.clear()

    def _announce(self) -> None:
        n = len(open_streams)
        if n:
            log.warning("shutting down: waiting up to %g s for %d in-flight request%s (Ctrl-C again to end %s now)",
                        self._grace_s, n, "" if n == 1 else "s", "it" if n == 1 else "them")
        else:
            log.info("shutting down")

    @staticmethod
    def _end_streams(message: str) -> None:
        ended = open_streams.end_all(message)
        if ended:
            log.warning("ended %d in-flight request%s: %s", ended, "" if ended == 1 else "s", message)
