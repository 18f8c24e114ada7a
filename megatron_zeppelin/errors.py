"""The user-facing error type every layer raises for bad input (standard library only)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value, flag or file is invalid; the message names it and what is allowed.

    Entry points print the message once, on one line, and exit with status 2."""
