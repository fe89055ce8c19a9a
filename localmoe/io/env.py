"""On/off switches read from the environment (``LOCALMOE_*``), parsed one way everywhere.

:func:`env_flag` takes ``1``/``true``/``yes``/``on`` as on and ``0``/``false``/``no``/``off``
as off (any case, surrounding spaces dropped); unset or empty keeps the default, and any other
value keeps it too, with one warning line through :mod:`logging` (logger
``localmoe.io.env``) naming the variable, the value and what is assumed.
"""

from __future__ import annotations

import functools
import logging
import os

__all__ = ["ON_WORDS", "OFF_WORDS", "env_flag"]

ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")

log = logging.getLogger(__name__)


def env_flag(name: str, default: bool | None) -> bool | None:
    """The on/off switch in environment variable ``name``: True for an on word, False for an
    off word, ``default`` when unset, empty or neither (the last logged as a warning, once per
    variable and value). ``default`` None stands for "automatic" (the caller decides)."""
    raw = os.environ.get(name)
    v = (raw or "").strip().lower()
    if v in ON_WORDS:
        return True
    if v in OFF_WORDS:
        return False
    if v:
        _warn(name, raw, default)
    return default


@functools.lru_cache(maxsize=None)
def _warn(name: str, raw: str, default: bool | None) -> None:
    assumed = "automatic" if default is None else "on" if default else "off"
    log.warning("%s=%r is not %s or %s; assuming the default (%s)", name, raw,
                "/".join(ON_WORDS), "/".join(OFF_WORDS), assumed)
