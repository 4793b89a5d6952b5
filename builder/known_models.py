"""Architecture facts of a few well-known models (builder/data/models/*.json: their published
config.json, no weights), so ``trtbuild plan`` works before a checkpoint is downloaded."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .frontend.checkpoint import ArchConfig, parse_arch


def _configs() -> dict[str, dict]:
    folder = resources.files(__package__).joinpath("data/models")
    return {entry.name[:-len(".json")]: json.loads(entry.read_text())
            for entry in folder.iterdir() if entry.name.endswith(".json")}


def known_names() -> list[str]:
    return sorted(_configs())


def find_known(name: str) -> str | None:
    """The known model a name (or a checkpoint dir's name) refers to, case-insensitively."""
    key = name.lower()
    for known, config in _configs().items():
        if key == known or key in (alias.lower() for alias in config["_aliases"]):
            return known
    return None


def known_arch(name: str) -> ArchConfig:
    return parse_arch(_configs()[name], Path(f"builder/data/models/{name}.json"))


def arch_for_absent_checkpoint(checkpoint: Path) -> tuple[str, ArchConfig] | None:
    """For a spec whose checkpoint is not here: the known model its dir name names, if any."""
    name = find_known(Path(checkpoint).name)
    return None if name is None else (name, known_arch(name))
