"""Does this Linux have the system libraries Qt's xcb platform plugin needs to open a window?

Qt's own failure is an abort that names the wrong library ("xcb-cursor0 ... is needed") when a fresh
Debian actually lacks libxcb-icccm4 and libxcb-keysyms1. `ldd` on the plugin and on Qt's xcb library
names every missing one; this prints the single install line instead. `make run` calls it
(`python -m app.qt_deps`); it imports no Qt module, so it runs even when Qt could not load.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
import os

# soname -> Debian package, for the ones whose package name is not the soname's obvious spelling.
_PACKAGES = {
    "libxcb-icccm.so.4": "libxcb-icccm4", "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-cursor.so.0": "libxcb-cursor0", "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0", "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0", "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0", "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-xkb.so.1": "libxcb-xkb1", "libxcb-util.so.1": "libxcb-util1", "libX11-xcb.so.1": "libx11-xcb1",
    "libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libOpenGL.so.0": "libopengl0",
    "libfontconfig.so.1": "libfontconfig1", "libdbus-1.so.3": "libdbus-1-3", "libglib-2.0.so.0": "libglib2.0-0",
}


def debian_package(soname: str) -> str:
    if soname in _PACKAGES:
        return _PACKAGES[soname]
    m = re.match(r"lib(.+)\.so\.(\d+)$", soname)
    return f"lib{m.group(1).lower()}{m.group(2)}" if m else soname


def qt_root() -> Path | None:
    spec = importlib.util.find_spec("PySide6")
    return Path(spec.origin).parent / "Qt" if spec and spec.origin else None


def missing_libraries(root: Path | None = None) -> list[str]:
    """Sonames that ldd reports 'not found' for the xcb plugin or Qt's xcb library (Linux only)."""
    root = root or qt_root()
    if not sys.platform.startswith("linux") or root is None or shutil.which("ldd") is None:
        return []
    missing: list[str] = []
    for lib in (root / "plugins" / "platforms" / "libqxcb.so", *sorted((root / "lib").glob("libQt6XcbQpa.so*"))[:1]):
        if not lib.exists():
            continue
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, timeout=30).stdout
        for name in re.findall(r"^\s*(\S+) => not found", out, re.M):
            if name not in missing:
                missing.append(name)
    return missing


def install_line(missing: list[str]) -> str:
    sudo = "sudo " if hasattr(os, "geteuid") and os.geteuid() != 0 else ""
    return f"{sudo}apt-get install -y " + " ".join(dict.fromkeys(debian_package(m) for m in missing))


def main() -> int:
    missing = missing_libraries()
    if not missing:
        return 0
    print(f"Qt cannot open a window: missing {', '.join(missing)}. Install them with:\n  {install_line(missing)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
