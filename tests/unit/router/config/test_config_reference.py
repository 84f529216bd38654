"""The config reference (the YAML blocks of docs/router.md and docs/discovery.md) and the config
model (``disagg_router.router.config.RouterSettings``) name the same options: a new option must be
documented, and a documented option must exist. Checked by name (the reference shows each section
once, e.g. ``prefill`` for both pools, the top level for a model's own settings)."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from disagg_router.router.config import RouterSettings

DOCS = Path(__file__).resolve().parents[4] / "docs"
REFERENCE = (DOCS / "router.md", DOCS / "discovery.md")


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def model_options(model: type[BaseModel]) -> set[str]:
    """Every option name of ``model`` and of the models its fields hold (lists, maps, unions)."""
    found = set()
    for name, field in model.model_fields.items():
        found.add(field.alias or name)
        for inner in _models_in(field.annotation):
            found |= model_options(inner)
    return found


def documented_options(value: Any, under_models: bool = False) -> set[str]:
    """Every mapping key of a parsed YAML block; the keys of ``models:`` are model names, not
    options, and only what they hold counts."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if not under_models:
                found.add(str(key))
            found |= documented_options(inner, under_models=key == "models" and not under_models)
    elif isinstance(value, list):
        for item in value:
            found |= documented_options(item)
    return found


def _reference() -> set[str]:
    found: set[str] = set()
    for path in REFERENCE:
        for block in path.read_text().split("```yaml\n")[1:]:
            found |= documented_options(yaml.safe_load(block.split("```", 1)[0]))
    return found


def test_the_reader_sees_nested_models_and_skips_model_names() -> None:
    assert {"discovery", "srv", "selector", "engine_id"} <= model_options(RouterSettings)
    parsed = yaml.safe_load("models:\n  big:\n    prefill: {policy: x}\n")
    assert documented_options(parsed) == {"models", "prefill", "policy"}


def test_every_option_is_documented() -> None:
    assert model_options(RouterSettings) - _reference() == set()


def test_every_documented_option_exists() -> None:
    assert _reference() - model_options(RouterSettings) == set()
