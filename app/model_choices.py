"""Per-model load choices (as LM Studio keeps per-model load defaults): today the image projector a
model loads with. Kept in `model-choices.json` in the data folder, by the model file's path; a model
without an entry takes the defaults.

The projector choice is what engine.api.LoadModel.mmproj takes: `AUTO` (None) loads an
mmproj-*.gguf found beside the model (engine/vision/find.py), `NONE` ("") loads none (the model reads
text only), any other value names the projector file."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

AUTO: str | None = None
NONE = ""
FILE_NAME = "model-choices.json"
log = logging.getLogger("strata.app")


class ModelChoices:
    """The one owner of the per-model choices file: read once, written whole on each change."""

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / FILE_NAME
        self._projectors: dict[str, str] = self._read()

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s could not be read (%s): every model takes its defaults", self.path.name, e)
            return {}
        got = data.get("projectors") if isinstance(data, dict) else None
        return {k: v for k, v in (got or {}).items() if isinstance(k, str) and isinstance(v, str)}

    def projector(self, model: str) -> str | None:
        """The projector `model` loads with: AUTO, NONE or a file's path."""
        return self._projectors.get(model, AUTO)

    def set_projector(self, model: str, choice: str | None) -> None:
        if choice is AUTO:
            self._projectors.pop(model, None)
        else:
            self._projectors[model] = choice
        self._write()

    def _write(self) -> None:
        """Atomically (a temporary file renamed over the old one): a crash leaves the old choices."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".model-choices-", dir=self.path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"projectors": self._projectors}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def projector_label(choice: str | None) -> str:
    """How the model list names a projector choice."""
    if choice is AUTO:
        return "automatic (an mmproj-*.gguf beside the model)"
    if choice == NONE:
        return "none (text only)"
    return Path(choice).name
