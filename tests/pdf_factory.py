"""Real PDF files for the documents tests, written byte by byte (no PDF library): a catalog, a page
tree, Helvetica, and one content stream per page drawing its lines as text. pypdf then reads them as
any PDF. `encrypted` re-saves one through pypdf's writer with a password; `image_only` has pages that
draw no text (as a scan's pages are images)."""
from __future__ import annotations

import zlib
from pathlib import Path


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _content(lines: list[str]) -> bytes:
    ops = ["BT", "/F1 10 Tf", "12 TL", "50 780 Td"]
    for line in lines:
        ops.append(f"({_escape(line)}) Tj T*")
    ops.append("ET")
    return "\n".join(ops).encode("latin-1", "replace")


def pdf_bytes(pages: list[list[str]], compress: bool = True, busy_ops: int = 0) -> bytes:
    """A PDF whose page i draws the lines pages[i] (latin-1 text); `busy_ops`: each page's content also
    holds that many save/restore pairs, which draw nothing but take a text extractor time (slow pages)."""
    n = len(pages)
    objs: list[bytes] = []
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objs.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objs.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    objs.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    for i, lines in enumerate(pages):
        objs.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                    f"/Contents {5 + 2 * i} 0 R >>".encode())
        data = _content(lines) + b"\n" + b"q Q " * busy_ops
        if compress:
            data = zlib.compress(data)
            objs.append(f"<< /Length {len(data)} /Filter /FlateDecode >>\nstream\n".encode() + data + b"\nendstream")
        else:
            objs.append(f"<< /Length {len(data)} >>\nstream\n".encode() + data + b"\nendstream")
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for k, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{k} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def write_pdf(path: Path, pages: list[list[str]], compress: bool = True) -> Path:
    Path(path).write_bytes(pdf_bytes(pages, compress))
    return Path(path)


def filler(page: int, n_lines: int = 30) -> list[str]:
    """Plain lines for page `page` (1-based) that share words across pages, so one fact stands out."""
    return [f"Page {page} line {k}: the survey notes describe weather, soil and the river crossing."
            for k in range(n_lines)]


def book(n_pages: int, facts: dict[int, str]) -> list[list[str]]:
    """`n_pages` filler pages; page p (1-based) of `facts` carries that line in its middle."""
    pages = []
    for p in range(1, n_pages + 1):
        lines = filler(p)
        if p in facts:
            lines.insert(15, facts[p])
        pages.append(lines)
    return pages


def encrypted(path: Path, pages: list[list[str]], password: str = "secret") -> Path:
    from pypdf import PdfReader, PdfWriter
    import io
    w = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes(pages))))
    w.encrypt(user_password=password, owner_password=password, algorithm="RC4-128")
    with open(path, "wb") as f:
        w.write(f)
    return Path(path)


def image_only(n_pages: int) -> bytes:
    """Pages that draw a filled rectangle and no text (what a scan's pages are to a text extractor)."""
    text_ops = _content(["x"])
    pdf = pdf_bytes([["x"]] * n_pages, compress=False)
    return pdf.replace(text_ops, b"0.5 g 50 50 500 700 re f".ljust(len(text_ops)))   # same length: offsets hold
