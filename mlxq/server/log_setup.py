"""The process's logging: one handler for mlxq's and uvicorn's lines, plain text or one JSON object per line.

mlxq writes one line per request (server/request_log.py), so uvicorn's access
log is off: it would double every request and log each dashboard poll and
health probe. With ``--log-format json`` every line is a JSON object (time,
level, logger, message; a request line's fields at the top level), so ``jq``
reads the whole log.
"""

from __future__ import annotations

import datetime
import logging

from mlxq.server.request_log import json_line

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)  # a request line: its fields, not a message
        if isinstance(fields, dict):
            line |= fields
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json_line(line)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # through the root handler, in the same format
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
