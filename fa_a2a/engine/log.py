"""log_once: the one home of "logged once" (a decision made once per signature, a fallback's reason)."""

from __future__ import annotations

import logging

__all__ = ["log_once"]

_seen: set = set()


def log_once(logger: logging.Logger, key, level: int, message: str, *args) -> bool:
    """logger.log(level, message, *args) the first time `key` (hashable; include what the message
    depends on) is seen in this process; True when it was logged."""
    if key in _seen:
        return False
    _seen.add(key)
    logger.log(level, message, *args)
    return True
