"""Draw Strata's app icon: a rounded tile holding a stack of gently waving rock strata.

Deterministic and dependency-light (numpy + the standard library): every size is
rendered from the same vector description with analytic anti-aliasing, so the
small sizes are drawn, not shrunk. Writes

    resources/icon.png     1024x1024 RGBA PNG (the source icon; Qt window icon, Linux)
    resources/strata.icns  macOS icon family (PNG-compressed members, 16..1024 px)

Run:  python resources/make_icon.py [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import struct
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# Apple's icon grid: on a 1024 canvas the tile is 824 wide, 100 px margin, ~185 px corners.
TILE_MARGIN = 100 / 1024
TILE_RADIUS = 185 / 1024

# Background of the tile, top to bottom (a night sky over the rock).
SKY_TOP = (0x1B, 0x24, 0x38)
SKY_BOTTOM = (0x2C, 0x3A, 0x55)

# The strata, top (youngest) to bottom (oldest): (colour, top edge as a fraction of the
# tile height, wave amplitude, wave phase). Each band fills down to the next band's edge.
STRATA = (
    ((0xF2, 0xC1, 0x6B), 0.34, 0.030, 0.00),  # sand
    ((0xE0, 0x8A, 0x4F), 0.47, 0.026, 0.90),  # ochre
    ((0xC0, 0x5A, 0x4A), 0.59, 0.022, 1.85),  # red clay
    ((0x7A, 0x4E, 0x6E), 0.70, 0.018, 2.70),  # shale
    ((0x3E, 0x5C, 0x7A), 0.81, 0.014, 3.60),  # slate (bedrock)
)
# A thin highlight along each band's upper edge, as if lit from above.
EDGE_LIGHT = 0.22
EDGE_WIDTH = 0.010

# The ICNS members macOS reads today (all PNG payloads): type -> pixel size.
ICNS_MEMBERS = (
    (b"icp4", 16),
    (b"icp5", 32),
    (b"icp6", 64),
    (b"ic07", 128),
    (b"ic08", 256),
    (b"ic09", 512),
    (b"ic10", 1024),  # 512@2x
    (b"ic11", 32),  # 16@2x
    (b"ic12", 64),  # 32@2x
    (b"ic13", 256),  # 128@2x
    (b"ic14", 512),  # 256@2x
)


def _coverage(signed_distance: np.ndarray) -> np.ndarray:
    """Pixel coverage from a signed distance in pixels (negative inside): a 1 px ramp."""
    return np.clip(0.5 - signed_distance, 0.0, 1.0)


def _rounded_rect_sd(px: np.ndarray, py: np.ndarray, size: int) -> np.ndarray:
    lo = TILE_MARGIN * size
    hi = size - lo
    r = TILE_RADIUS * size
    cx = cy = size / 2
    half = (hi - lo) / 2
    qx = np.abs(px - cx) - (half - r)
    qy = np.abs(py - cy) - (half - r)
    outside = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0))
    inside = np.minimum(np.maximum(qx, qy), 0)
    return outside + inside - r


def _wave(u: np.ndarray, amplitude: float, phase: float) -> tuple[np.ndarray, np.ndarray]:
    """Height of a band edge (fraction of the tile) at horizontal position u in [0, 1], and its slope."""
    k1, k2 = 2 * np.pi * 1.15, 2 * np.pi * 2.3
    y = amplitude * (np.sin(k1 * u + phase) + 0.35 * np.sin(k2 * u + 1.7 * phase))
    dy = amplitude * (k1 * np.cos(k1 * u + phase) + 0.35 * k2 * np.cos(k2 * u + 1.7 * phase))
    return y, dy


def render(size: int) -> np.ndarray:
    """The icon as a (size, size, 4) uint8 RGBA array."""
    coords = np.arange(size, dtype=np.float64) + 0.5
    px, py = np.meshgrid(coords, coords)
    lo = TILE_MARGIN * size
    span = size - 2 * lo
    u = (px - lo) / span  # 0..1 across the tile
    v = (py - lo) / span  # 0..1 down the tile

    t = np.clip(v, 0, 1)[..., None]
    rgb = (1 - t) * np.array(SKY_TOP, float) + t * np.array(SKY_BOTTOM, float)

    for colour, top, amplitude, phase in STRATA:
        wave, slope = _wave(u, amplitude, phase)
        edge = top + wave
        # Signed distance to the edge in pixels, corrected for the slope (negative below it).
        sd = (edge - v) * span / np.sqrt(1 + slope**2)
        band = _coverage(sd)[..., None]
        base = np.array(colour, float)
        # Darken a touch with depth inside the band, for a little volume.
        depth = np.clip((v - edge) / 0.12, 0, 1)[..., None]
        fill = base * (1 - 0.18 * depth)
        # The lit rim just under the edge.
        # -sd is the distance below the edge; the rim is the first EDGE_WIDTH of it.
        rim = _coverage(-sd - EDGE_WIDTH * span)[..., None]
        fill = fill + (255 - fill) * EDGE_LIGHT * rim
        rgb = rgb * (1 - band) + fill * band

    alpha = _coverage(_rounded_rect_sd(px, py, size))
    out = np.empty((size, size, 4), np.uint8)
    out[..., :3] = np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    out[..., 3] = np.clip(np.rint(alpha * 255), 0, 255).astype(np.uint8)
    # Fully transparent pixels carry no colour, so the file does not depend on float noise there.
    out[out[..., 3] == 0] = 0
    return out


def png_bytes(rgba: np.ndarray) -> bytes:
    """Encode an RGBA uint8 array as a PNG (filter 0 on every row, zlib level 9)."""
    h, w, _ = rgba.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + rgba[row].tobytes() for row in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def icns_bytes(pngs_by_size: dict[int, bytes]) -> bytes:
    """An .icns file: a TOC followed by one PNG member per ICNS_MEMBERS entry."""
    members = [(kind, pngs_by_size[px]) for kind, px in ICNS_MEMBERS]
    toc = b"".join(kind + struct.pack(">I", len(data) + 8) for kind, data in members)
    body = b"TOC " + struct.pack(">I", len(toc) + 8) + toc
    body += b"".join(kind + struct.pack(">I", len(data) + 8) + data for kind, data in members)
    return b"icns" + struct.pack(">I", len(body) + 8) + body


def build(out_dir: Path) -> tuple[Path, Path]:
    sizes = sorted({px for _, px in ICNS_MEMBERS} | {1024})
    pngs = {px: png_bytes(render(px)) for px in sizes}
    out_dir.mkdir(parents=True, exist_ok=True)
    png_path = out_dir / "icon.png"
    icns_path = out_dir / "strata.icns"
    png_path.write_bytes(pngs[1024])
    icns_path.write_bytes(icns_bytes(pngs))
    return png_path, icns_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args(argv)
    for path in build(args.out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
