"""Logging for gpudra's processes: human text, or one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import os
import sys

LEVEL_ENV = "GPUDRA_LOG_LEVEL"  # e.g. DEBUG; overrides the level a command asks for


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    override = logging.getLevelName(os.environ.get(LEVEL_ENV, "").upper())
    if isinstance(override, int):  # an unknown name yields a string: keep the default
        level = override
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
