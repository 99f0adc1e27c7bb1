"""The error a bad config value, key, preset or command-line path raises: one line naming what
is wrong and what is allowed (the commands print it as ``error: ...`` and exit 2)."""


class ConfigError(ValueError):
    """A config value, key or preset is invalid."""
