"""Text out of a document file: plain text, Markdown, code and CSV read as text, PDF through pypdf.

Bounds (each refusal is one line naming the file and the bound):
- MAX_FILE_BYTES: the file's size, checked before it is read;
- MAX_PDF_PAGES: a PDF's page count, checked before any page is read;
- MAX_TEXT_CHARS: the extracted text (a text file's characters, a PDF's text of all pages);
- pypdf's own limits on what one compressed stream may expand to (75 MB: a zip bomb is refused);
- time and memory: the app runs this in a child process (`worker`), killed past its bounds.
A PDF whose pages hold no text (scanned pages are images) says so: there is no OCR. An encrypted PDF
is refused (one with an empty user password is opened). A file that is not what its name says (binary
bytes in a .txt, a .pdf without the PDF header) is refused as such."""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MAX_FILE_BYTES = 64 << 20          # 64 MiB: any document file
MAX_PDF_PAGES = 1000
MAX_TEXT_CHARS = 2_000_000         # about 500k tokens of English
PDF_MAGIC = b"%PDF-"
HEAD_BYTES = 1024                  # the PDF header may follow some junk (as readers accept)
# a text file whose first 64 KiB has more than this share of control characters is binary
CONTROL_SHARE = 0.01
_CONTROLS = frozenset(range(0, 9)) | frozenset(range(14, 32)) | {11, 127}

CODE_SUFFIXES = (".py", ".js", ".ts", ".tsx", ".jsx", ".c", ".h", ".cc", ".cpp", ".hpp", ".m", ".mm",
                 ".rs", ".go", ".java", ".kt", ".swift", ".rb", ".php", ".cs", ".sh", ".zsh", ".bash",
                 ".sql", ".html", ".htm", ".css", ".scss", ".json", ".jsonl", ".yaml", ".yml", ".toml",
                 ".ini", ".cfg", ".xml", ".lua", ".r", ".jl", ".scala", ".pl", ".hs", ".ex", ".exs",
                 ".zig", ".dart", ".vue", ".svelte", ".tex", ".make", ".cmake", ".gradle", ".proto")
KINDS = {".txt": "text", ".text": "text", ".log": "text", ".rst": "text",
         ".md": "markdown", ".markdown": "markdown", ".mdx": "markdown",
         ".csv": "csv", ".tsv": "csv", ".pdf": "pdf", **{s: "code" for s in CODE_SUFFIXES}}
KIND_NAMES = {"Makefile": "code", "Dockerfile": "code", "README": "text", "LICENSE": "text"}


class DocumentError(Exception):
    """Why a file is not read: one line for the person who attached it."""


class Cancelled(Exception):
    """The person cancelled the extraction."""


@dataclass(frozen=True)
class Extracted:
    name: str                      # the file's name (no folder)
    kind: str                      # text | markdown | code | csv | pdf
    text: str
    pages: tuple[int, ...] = ()    # PDF: where each page's text starts in `text`; () for other kinds
    empty_pages: int = 0           # PDF pages without text (images, blank)


def kind_of(path: str | Path) -> str | None:
    """The document kind a file's name says (None: not a document Strata reads)."""
    p = Path(path)
    return KINDS.get(p.suffix.lower()) or KIND_NAMES.get(p.name)


def extract(path: str | Path, progress: Callable[[int, int], None] | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> Extracted:
    """The file's text, or DocumentError (one line) / Cancelled. `progress(done, total)` after each PDF
    page; `cancelled()` is asked between pages."""
    p = Path(path)
    kind = kind_of(p)
    if kind is None:
        raise DocumentError(f"{p.name}: Strata reads text, Markdown, code, CSV and PDF files")
    data = _read_bounded(p)
    if kind == "pdf":
        return _pdf(p.name, data, progress or (lambda d, t: None), cancelled)
    return Extracted(p.name, kind, _text(p.name, data))


def _read_bounded(p: Path) -> bytes:
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise DocumentError(f"{p.name} is not a regular file")
        if size > MAX_FILE_BYTES:
            raise DocumentError(f"{p.name} is {size / (1 << 20):.1f} MiB; Strata reads documents up to "
                                f"{MAX_FILE_BYTES >> 20} MiB")
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise DocumentError(f"{p.name} cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:       # grew since the stat
        raise DocumentError(f"{p.name} is larger than {MAX_FILE_BYTES >> 20} MiB")
    return data


def _decode(name: str, data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            raise DocumentError(f"{name} is not text: it starts as UTF-16 but does not decode") from None
    if b"\x00" in data:
        raise DocumentError(f"{name} is not text: it holds binary data")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    head = data[:65536]
    if sum(b in _CONTROLS for b in head) > CONTROL_SHARE * len(head):
        raise DocumentError(f"{name} is not text: it holds binary data")
    return data.decode("cp1252", "replace")       # an older 8-bit text file (Windows or Latin-1)


def _text(name: str, data: bytes) -> str:
    text = _decode(name, data).replace("\r\n", "\n").replace("\r", "\n")
    if len(text) > MAX_TEXT_CHARS:
        raise DocumentError(f"{name} has {len(text):,} characters; Strata reads documents up to "
                            f"{MAX_TEXT_CHARS:,}")
    if not text.strip():
        raise DocumentError(f"{name} is empty")
    return text


def _pdf(name: str, data: bytes, progress: Callable[[int, int], None], cancelled: Callable[[], bool]) -> Extracted:
    if PDF_MAGIC not in data[:HEAD_BYTES]:
        raise DocumentError(f"{name} is not a PDF file (it has no %PDF- header)")
    logging.getLogger("pypdf").setLevel(logging.ERROR)    # a damaged file's warnings are not the user's
    reader = _open_pdf(name, data)
    n = _page_count(name, reader)
    if n > MAX_PDF_PAGES:
        raise DocumentError(f"{name} has {n:,} pages; Strata reads PDFs up to {MAX_PDF_PAGES:,} pages")
    parts: list[str] = []
    starts: list[int] = []
    size = empty = 0
    for i in range(n):
        if cancelled():
            raise Cancelled()
        text = _page_text(name, reader, i)
        empty += not text.strip()
        starts.append(size)
        parts.append(text)
        size += len(text) + 2
        if size > MAX_TEXT_CHARS:
            raise DocumentError(f"{name} has more than {MAX_TEXT_CHARS:,} characters of text (at page {i + 1} "
                                f"of {n}); Strata reads documents up to {MAX_TEXT_CHARS:,}")
        progress(i + 1, n)
    if n == 0 or empty == n:
        raise DocumentError(f"{name} has no text layer (a scanned PDF?): Strata reads a PDF's text and "
                            "does not recognise text in images")
    return Extracted(name, "pdf", "\n\n".join(parts), tuple(starts), empty)


def _damaged(name: str, e: BaseException) -> DocumentError:
    first = (str(e).splitlines() or [""])[0][:160]
    return DocumentError(f"{name} is damaged and cannot be read ({type(e).__name__}{': ' + first if first else ''})")


def _open_pdf(name: str, data: bytes):
    from pypdf import PdfReader      # lazy: only a PDF needs pypdf, and the worker process imports it once
    from pypdf.errors import DependencyError, FileNotDecryptedError
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            try:
                ok = reader.decrypt("")
            except DependencyError:
                raise DocumentError(f"{name} is encrypted (AES); Strata does not open encrypted PDFs: save "
                                    "a copy without a password") from None
            except FileNotDecryptedError:
                ok = 0
            if not ok:
                raise DocumentError(f"{name} is password-protected; Strata does not open encrypted PDFs: "
                                    "save a copy without a password")
        return reader
    except (DocumentError, MemoryError):
        raise
    except RecursionError as e:
        raise _damaged(name, e) from None
    except Exception as e:  # noqa: BLE001 -- pypdf raises many kinds on a damaged file: one line names it
        raise _damaged(name, e) from None


def _page_count(name: str, reader) -> int:
    try:
        return len(reader.pages)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged page tree
        raise _damaged(name, e) from None


def _page_text(name: str, reader, i: int) -> str:
    from pypdf.errors import LimitReachedError      # lazy: as _open_pdf
    try:
        return reader.pages[i].extract_text() or ""
    except LimitReachedError:
        raise DocumentError(f"{name}: a compressed stream on page {i + 1} expands past pypdf's limit "
                            "(a zip bomb?); not read") from None
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 -- one damaged page: counted as a page without text, the rest read
        return ""
