"""``ConfigError``: the one exception for a configuration a person must fix."""


class ConfigError(ValueError):
    """A configuration a person must fix; the message says what and how."""
