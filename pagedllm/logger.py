"""The "pagedllm" logger's own stderr handler, set up on import (as vLLM does).

Without it `from pagedllm import LLM; LLM()` shows no INFO line (the KV cache size, a kernel build),
since Python's last-resort handler prints warnings only. PAGEDLLM_CONFIGURE_LOGGING=0 leaves the
logger alone, for applications that configure logging themselves.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "pagedllm"
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment, so a later redirect (pytest's capture,
    contextlib.redirect_stderr) is honoured, not the stream that was current at import."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # StreamHandler.__init__ and setStream assign it; the property always reads sys.stderr


def configure_logging() -> None:
    if os.environ.get("PAGEDLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger(LOGGER_NAME)
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return  # a module reload must not add a second handler (each line would print twice)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    # Not to the root logger as well: the CLI's logging.basicConfig would print every line twice.
    logger.propagate = False
