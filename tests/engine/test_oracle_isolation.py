"""The llama.cpp oracle is built portable and runs out of process (issue: SIGILL on AMX-advertising VMs)."""
from __future__ import annotations

import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import llama_oracle

AMX = ("tileloadd", "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud", "tdpbf16ps", "ldtilecfg", "sttilecfg", "tilezero")


def _llama_libs() -> list[Path]:
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    return sorted(p for p in Path(spec.origin).parent.rglob("*.so*") if p.is_file()) if spec else []


@pytest.mark.oracle
@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX exists only on x86-64")
def test_oracle_libraries_contain_no_amx_instructions():
    llama_oracle.require()
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    libs = _llama_libs()
    assert any("ggml-cpu" in p.name for p in libs), libs
    for lib in libs:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                              text=True, timeout=300).stdout
        found = sorted({op for op in AMX if f"\t{op} " in text or f"\t{op}\n" in text})
        assert not found, f"{lib.name} was built with AMX instructions {found}: rebuild with `make oracle-wheel`"


@pytest.mark.oracle
@pytest.mark.parametrize("sig", [signal.SIGILL, signal.SIGSEGV])
def test_a_native_crash_fails_one_call_naming_the_signal(sig):
    with pytest.raises(llama_oracle.OracleCrashed, match=f"signal {sig.name}"):
        llama_oracle._request("fn", "die", (int(sig),), {})
    # The next call gets a fresh worker: the rest of the run goes on.
    assert llama_oracle.has_cvec() in (True, False)


@pytest.mark.oracle
def test_objects_of_a_dead_worker_are_refused_not_confused(tiny_gguf):
    llm = llama_oracle.Llama(model_path=str(tiny_gguf), n_ctx=32, vocab_only=True, verbose=False)
    ids = llm.tokenize(b"Hello", add_bos=False, special=True)
    assert ids and all(isinstance(i, int) for i in ids)
    with pytest.raises(llama_oracle.OracleCrashed):
        llama_oracle._request("fn", "die", (int(signal.SIGKILL),), {})
    with pytest.raises(llama_oracle.OracleCrashed, match="earlier oracle worker"):
        llm.tokenize(b"Hello", add_bos=False, special=True)


def test_qt_deps_names_missing_libraries_and_their_packages(tmp_path):
    """A plugin linked against a library that is not there: ldd says so, and the line names the package.
    The library's soname is one no system has: with a real name (libxcb-keysyms.so.1) ldd found the
    machine's own copy once the README's apt-get line had been run, and the test failed there."""
    from app import qt_deps
    if not sys.platform.startswith("linux") or shutil.which("gcc") is None or shutil.which("ldd") is None:
        pytest.skip("needs Linux with gcc and ldd")
    soname = "libxcb-strata-absent.so.1"
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text("int dep(void); int plugin(void) { return dep(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o",
                    str(tmp_path / soname), str(tmp_path / "dep.c")], check=True)
    plugins = tmp_path / "Qt" / "plugins" / "platforms"
    plugins.mkdir(parents=True)
    (tmp_path / "Qt" / "lib").mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(plugins / "libqxcb.so"), str(tmp_path / "plugin.c"),
                    str(tmp_path / soname)], check=True)
    (tmp_path / soname).unlink()
    missing = qt_deps.missing_libraries(tmp_path / "Qt")
    assert missing == [soname]
    assert qt_deps.install_line(missing).endswith("apt-get install -y libxcb-strata-absent1")
    assert qt_deps.install_line(["libxcb-keysyms.so.1"]).endswith("apt-get install -y libxcb-keysyms1")
    assert qt_deps.debian_package("libxcb-icccm.so.4") == "libxcb-icccm4"
    assert qt_deps.debian_package("libxcb-foo.so.2") == "libxcb-foo2"
