"""What every section of the config shares: frozen models that reject unknown keys, and the
keys renamed in a release (read under their new names, warned about by :func:`deprecated_keys`).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


RENAMED_KEYS: dict[str, dict[str, str]] = {
    "timeouts": {"discovery": "identity_probe"},
    "health": {"discovery_interval": "identity_interval", "discovery_prompt": "identity_prompt"},
}
"""Per section, old key -> new key ("discovery" names pool membership only; identity probing has
its own keys). An old key is read as its new one; giving both is an error naming both."""


def renamed_keys(section: str, data: Any) -> Any:
    """``data`` with the section's old keys under their new names; ValueError if both given."""
    renamed = RENAMED_KEYS[section]
    if not isinstance(data, dict) or not renamed.keys() & data.keys():
        return data
    out = dict(data)
    for old, new in renamed.items():
        if old in out and new in out:
            raise ValueError(
                f"{section}.{old} is the deprecated name of {section}.{new}: give only {new}"
            )
        if old in out:
            out[new] = out.pop(old)
    return out


def deprecated_keys(data: Any) -> list[str]:
    """One warning per old key a parsed config still uses, naming old -> new.

    Who calls it: :func:`load_config` (which hands each to its ``on_deprecated``)."""
    found = []
    for section, renamed in RENAMED_KEYS.items():
        given = data.get(section) if isinstance(data, dict) else None
        for old, new in renamed.items():
            if isinstance(given, dict) and old in given:
                found.append(
                    f"config key {section}.{old} is deprecated: use {section}.{new} "
                    "(the old name is still read in this release)"
                )
    return found
