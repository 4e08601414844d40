"""structlog setup: JSON lines for machines, a console renderer for people.

Library code only calls ``get_logger``; ``configure_logging`` is called once at the edge
(CLI, tests) and may be called again to reconfigure.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog

from pushsvc.errors import ConfigError

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# The stdlib handler we installed last, so a reconfigure replaces it without touching
# handlers that others (pytest's caplog, an embedding application) put on the root logger.
_stdlib_handler: logging.Handler | None = None


def configure_logging(fmt: str, level: str, stream: IO[str] | None = None) -> None:
    """Send structlog events, and stdlib records at WARNING or above, to ``stream``."""
    global _stdlib_handler
    stream = sys.stderr if stream is None else stream
    if fmt not in ("auto", "json", "console"):
        raise ConfigError("log_format", f"unknown log format {fmt!r}")
    if level not in _LEVELS:
        raise ConfigError("log_level", f"unknown log level {level!r}")
    tty = _isatty(stream)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if fmt == "json" or (fmt == "auto" and not tty):
        # A traceback must become a string inside the one JSON line, not extra lines.
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        # ConsoleRenderer formats exc_info itself (prettier), and warns if it was pre-formatted.
        renderer = structlog.dev.ConsoleRenderer(colors=tty)

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *args: _NamedWriteLogger(stream, *args[:1]),
        # Caching would pin module-level loggers to the first configuration seen.
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    # Library chatter below WARNING is noise; above our own level it is still wanted.
    root.setLevel(max(logging.WARNING, _LEVELS[level]))
    _stdlib_handler = handler


def get_logger(name: str) -> Any:
    """A structlog logger whose events carry ``logger=name``."""
    return structlog.get_logger(name)


class _NamedWriteLogger(structlog.WriteLogger):
    # WriteLogger drops the name given to get_logger; keeping it lets add_logger_name
    # label structlog events and stdlib records the same way.
    def __init__(self, file: IO[str], name: str = "") -> None:
        super().__init__(file)
        self.name = name


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
