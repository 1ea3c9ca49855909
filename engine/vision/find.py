"""Which projector a load takes (plain Python): a named mmproj file, else one found beside the model
by name (the same rule as a Qwen3.5 model's mtp-*.gguf): an mmproj-*.gguf naming the model's file
stem, else the only mmproj-*.gguf in its folder."""
from __future__ import annotations

from pathlib import Path


def find_beside(model_path: Path) -> Path | None:
    try:
        sibs = sorted(p for p in model_path.parent.glob("mmproj-*.gguf") if p.is_file())
    except OSError:
        return None
    stem = model_path.stem.lower()
    named = [p for p in sibs if stem in p.stem.lower()]
    if named:
        return named[0]
    return sibs[0] if len(sibs) == 1 else None


def chosen(model_path: Path, asked: str | None) -> tuple[Path | None, bool]:
    """(the projector to load, whether it was named): `asked` None looks beside the model, "" is none."""
    if asked == "":
        return None, False
    if asked is not None:
        return Path(asked).expanduser(), True
    return find_beside(model_path), False
