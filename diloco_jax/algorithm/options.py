"""Bad arguments of the library, named so that an edge can name its own keys.

Every check of an argument's range, and of which pieces combine, lives next to the piece it
guards and raises :class:`OptionError`, whose ``option`` names the argument as the library
spells it (``sync_every``, ``streaming.mix``, ``codec.block``, ``dct.topk``, ...). Its ``allowed``
text may mention other arguments as ``{name}``; :meth:`OptionError.render` writes them with an
edge's names (the config layer: ``outer.sync_every``, ``compress.block``), ``str()`` with the
library's. So each rule is written once, for library users and config users alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


class OptionError(ValueError):
    """``option = value`` is invalid: ``allowed``. A :class:`ValueError`.

    Args:
      option: the argument as the library spells it (``sync_every``, ``streaming.mix``,
        ``codec.block``, ...).
      value: the value given.
      allowed: what the argument allows; it may name other arguments as ``{name}``, which
        :meth:`render` writes with an edge's names.
    """

    def __init__(self, option: str, value: Any, allowed: str):
        self.option, self.value, self.allowed = option, value, allowed
        super().__init__(f"{option} = {value!r} is invalid: {self.render({})}")

    def render(self, names: Mapping[str, str]) -> str:
        """``allowed`` with every ``{name}`` written as ``names.get(name, name)``."""
        return re.sub(r"\{([\w.]+)\}", lambda m: names.get(m.group(1), m.group(1)), self.allowed)


def require(ok: bool, option: str, value: Any, allowed: str) -> None:
    """Raises :class:`OptionError` unless ``ok``."""
    if not ok:
        raise OptionError(option, value, allowed)
