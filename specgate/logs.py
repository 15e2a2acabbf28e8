"""Log lines as JSON objects, one a line, for the router and the operator: what log
collectors parse without a pattern. Extra fields of a record (request_id, pod, ...) become
keys."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_FIELD_TYPES = (str, int, float, bool, type(None), dict, list, tuple)
"""Extra fields logged as keys: data. Objects a library attaches to its records (kopf's whole
settings object, on every line) are left out."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line; extra fields (request_id, pod, ...) become keys. Request
    headers are never logged: they carry API keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            # UTC to the millisecond, as RFC 3339 with its zone: what collectors sort on.
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(
            {
                k: v
                for k, v in record.__dict__.items()
                if k not in _STANDARD and isinstance(v, _FIELD_TYPES)
            }
        )
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str = "json") -> None:
    """The process's root logging: JSON lines (or `text`) to stderr at `level`."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
