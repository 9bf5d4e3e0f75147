"""The corpus: inputs that found bugs, one JSON file per target under ``corpus/``, each a list of
``{"input": ..., "found": "what it found"}``. Tests replay them as explicit examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "corpus"


def load(target: str) -> list[Any]:
    """The inputs recorded for ``target`` (``corpus/<target>.json``); [] when none."""
    path = CORPUS / f"{target}.json"
    if not path.exists():
        return []
    return [entry["input"] for entry in json.loads(path.read_text())]
