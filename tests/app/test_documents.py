"""Documents in a chat, below the window: real files of each kind read into text under their caps, bad
files refused with one line (encrypted, truncated, not a PDF, a zip bomb, a scan, binary in a .txt, a
text file past the cap), chunks with their places, the chat database's index (BM25 over the chat's
documents, removed with the chat, back on undo, found by the library search), the prompt a question
with sources makes and the citations linked back. A seeded fuzz over PDF bytes ends every file in text
or a one-line refusal within a generous bound (the child process is killed past it)."""
from __future__ import annotations

import random
import re
import sqlite3
import zlib
from pathlib import Path

import psutil
import pytest

from app.documents import extract as ex
from app.documents.chunks import CHUNK_CHARS, OVERLAP_CHARS, chunk
from app.documents.index import PASSAGES, TOP_K, WHOLE, ChatDocuments
from app.documents.prompt import (expand, find_source, for_question, link_citations, rename_documents,
                                  sources_of_reply)
from app.documents.worker import extract_bounded
from app.store import Chat, Store
from pdf_factory import book, encrypted, image_only, pdf_bytes, write_pdf

FACT = "The lighthouse keeper's cat is named Marmalade Quillfeather."
QUESTION = "What is the name of the lighthouse keeper's cat?"


@pytest.fixture(scope="module")
def book_pdf(tmp_path_factory) -> Path:
    return write_pdf(tmp_path_factory.mktemp("pdf") / "survey.pdf", book(200, {150: FACT}))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def _chat(store: Store, title: str = "New chat") -> Chat:
    c = Chat(title=title)
    store.save_chat(c)
    return c


def test_a_200_page_pdf_question_retrieves_page_150_with_its_citation(book_pdf, store):
    doc = ex.extract(book_pdf)
    assert (doc.kind, len(doc.pages), doc.empty_pages) == ("pdf", 200, 0)
    docs = ChatDocuments(store.db, _chat(store).id, store.doc_fts)
    info = docs.add(doc)
    docs.set_mode(info.id, PASSAGES, 120_000)
    srcs = for_question(docs, QUESTION, [])
    assert 1 <= len(srcs) <= TOP_K          # only chunks holding a word of the question are ranked
    top = srcs[0]
    assert FACT in top["text"].replace("\n", " ")
    assert "150" in top["place"] and top["name"] == "survey.pdf"
    sent = expand([{"role": "user", "content": QUESTION, "documents": srcs}], docs.text)[0]
    assert "documents" not in sent
    assert f"[1] survey.pdf, {top['place']}:" in sent["content"] and "Marmalade Quillfeather" in sent["content"]
    assert sent["content"].rstrip().endswith(f"Question: {QUESTION}")
    # the reply's [1] links back to that passage
    msgs = [{"role": "user", "content": QUESTION, "documents": srcs},
            {"role": "assistant", "content": "Marmalade Quillfeather [1]."}]
    at, reply_srcs = sources_of_reply(msgs, 1)
    assert "(cite:0:1)" in link_citations(msgs[1]["content"], at, reply_srcs)
    assert find_source(msgs, 0, 1)["text"] == top["text"]


def test_a_document_that_fits_goes_in_whole_once(tmp_path, store):
    p = tmp_path / "notes.md"
    p.write_text("# Notes\n\nThe door code is 4711.\n")
    docs = ChatDocuments(store.db, _chat(store).id, store.doc_fts)
    info = docs.add(ex.extract(p))
    docs.set_mode(info.id, WHOLE, 20)
    first = for_question(docs, "What is the door code?", [])
    assert [(s["mode"], s["name"], s["place"]) for s in first] == [(WHOLE, "notes.md", "whole document")]
    sent = expand([{"role": "user", "content": "What is the door code?", "documents": first}], docs.text)[0]
    assert "<document>\n# Notes\n\nThe door code is 4711.\n\n</document>" in sent["content"]
    history = [{"role": "user", "content": "q", "documents": first}, {"role": "assistant", "content": "4711"}]
    assert for_question(docs, "and again?", history) == []        # in the history already


@pytest.mark.parametrize("name,data,kind", [
    ("a.txt", b"alpha\nbeta\n", "text"), ("b.md", "# T\u00e9l\u00e9\n".encode(), "markdown"),
    ("c.py", b"def f():\n    return 1\n", "code"), ("d.csv", b"x,y\n1,2\n", "csv"),
    ("e.txt", "caf\u00e9".encode("cp1252"), "text"), ("f.txt", "\ufeffutf16 text".encode("utf-16"), "text")])
def test_text_kinds_are_read(tmp_path, name, data, kind):
    p = tmp_path / name
    p.write_bytes(data)
    doc = ex.extract(p)
    assert doc.kind == kind and doc.text.strip() and "\r" not in doc.text


def test_chunks_cover_the_text_with_their_stated_overlap_and_places(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text("".join(f"line {i} of the log, with some words to fill it out.\n" for i in range(1, 2001)))
    doc = ex.extract(p)
    parts = chunk(doc)
    assert parts[0].start == 0 and parts[-1].end == len(doc.text)
    for a, b in zip(parts, parts[1:]):
        assert a.end - a.start <= CHUNK_CHARS
        assert 0 < a.end - b.start <= OVERLAP_CHARS       # overlapping, never more than stated
    first_line = int(re.match(r"line (\d+)", parts[5].text).group(1))      # chunks start at a line
    last_line = doc.text.count("\n", 0, parts[5].end - 1) + 1
    assert parts[5].place == f"lines {first_line}-{last_line}"


def test_a_csv_chunk_keeps_its_header(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("city,population\n" + "".join(f"town{i},{i * 17}\n" for i in range(800)))
    parts = chunk(ex.extract(p))
    assert len(parts) > 3 and all(c.text.startswith("city,population\n") for c in parts)


def _truncated(tmp: Path) -> Path:
    data = pdf_bytes(book(3, {}))
    (tmp / "cut.pdf").write_bytes(data[:len(data) // 3])
    return tmp / "cut.pdf"


def _bomb(tmp: Path) -> Path:
    good = pdf_bytes([["hello"]])
    z = zlib.compressobj(9)
    data = z.compress(b"BT /F1 10 Tf 50 700 Td (hi) Tj ET\n") + z.compress(b" " * (100 << 20)) + z.flush()
    m = re.search(rb"<< /Length (\d+) /Filter /FlateDecode >>\nstream\n", good)
    rest = good[m.end() + int(m.group(1)):]
    (tmp / "bomb.pdf").write_bytes(good[:m.start()] + f"<< /Length {len(data)} /Filter /FlateDecode >>\nstream\n"
                                   .encode() + data + rest)
    return tmp / "bomb.pdf"


BAD = {
    "encrypted": (lambda t: encrypted(t / "locked.pdf", [["secret text"]]), "locked.pdf is password-protected"),
    "truncated": (_truncated, "cut.pdf"),
    "not a PDF": (lambda t: (t / "fake.pdf").write_bytes(b"PK\x03\x04 a zip file" * 50) and t / "fake.pdf",
                  "fake.pdf is not a PDF file"),
    "zip bomb": (_bomb, "bomb.pdf: a compressed stream on page 1 expands past"),
    "scanned": (lambda t: (t / "scan.pdf").write_bytes(image_only(4)) and t / "scan.pdf",
                "scan.pdf has no text layer (a scanned PDF?)"),
    "binary .txt": (lambda t: (t / "bin.txt").write_bytes(bytes(range(256)) * 64) and t / "bin.txt",
                    "bin.txt is not text: it holds binary data"),
    "binary .txt, no NUL": (lambda t: (t / "ctl.txt").write_bytes(bytes(range(1, 32)) * 300 + b"\xff") and t / "ctl.txt",
                            "ctl.txt is not text"),
    "huge text": (lambda t: (t / "huge.txt").write_bytes(b"word " * (ex.MAX_TEXT_CHARS // 5 + 10)) and t / "huge.txt",
                  f"huge.txt has 2,000,050 characters; Strata reads documents up to {ex.MAX_TEXT_CHARS:,}"),
    "empty": (lambda t: (t / "e.md").write_bytes(b"\n \n") and t / "e.md", "e.md is empty"),
    "not a document": (lambda t: (t / "x.exe").write_bytes(b"MZ") and t / "x.exe", "x.exe: Strata reads text"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_refused_with_one_line(tmp_path, case):
    make, says = BAD[case]
    path = make(tmp_path)
    with pytest.raises(ex.DocumentError) as e:
        ex.extract(path)
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg
    if case == "truncated":          # a page tree cut off: named as damaged or as holding no text
        assert "is damaged" in msg or "has no text layer" in msg


def test_the_size_and_page_caps(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(ex.MAX_FILE_BYTES + 1)            # sparse: nothing is read
    with pytest.raises(ex.DocumentError, match=r"big.txt is 64.0 MiB; Strata reads documents up to 64 MiB"):
        ex.extract(big)
    monkeypatch.setattr(ex, "MAX_PDF_PAGES", 5)
    p = write_pdf(tmp_path / "long.pdf", book(6, {}))
    with pytest.raises(ex.DocumentError, match="long.pdf has 6 pages; Strata reads PDFs up to 5 pages"):
        ex.extract(p)


def test_the_child_process_reads_refuses_and_cancels(book_pdf, tmp_path):
    seen = []
    out = extract_bounded(book_pdf, progress=lambda d, t: seen.append((d, t)))
    assert out.doc is not None and len(out.doc.pages) == 200 and seen[-1] == (200, 200)
    bad = extract_bounded(encrypted(tmp_path / "locked.pdf", [["x"]]))
    assert bad.doc is None and bad.error.startswith("locked.pdf is password-protected")
    gone = extract_bounded(book_pdf, cancelled=lambda: True)
    assert gone.cancelled and gone.doc is None


def _spawned() -> list[psutil.Process]:
    """This process's children started by multiprocessing's spawn (the readers; not its resource tracker)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in part for part in p.cmdline()):
                out.append(p)
        except psutil.Error:           # gone meanwhile
            pass
    return out


def test_the_reader_is_stopped_at_its_time_and_memory_bounds_while_it_reports_pages(tmp_path):
    """A reader still making progress (a page a message) is held to both bounds; none is left running."""
    # 200 slow pages: a quarter to half a second each, so one to two minutes to read; 8 s is a bound it
    # meets only by being stopped, and leaves a loaded machine time to start the reader and report pages
    slow_pdf = tmp_path / "slow.pdf"
    slow_pdf.write_bytes(pdf_bytes(book(200, {}), busy_ops=40_000))
    before = {p.pid for p in _spawned()}
    pages: list[int] = []
    slow = extract_bounded(slow_pdf, progress=lambda d, t: pages.append(d), seconds=8)
    assert slow.doc is None and slow.error == "slow.pdf takes longer than 8 s to read; not read"
    assert pages and pages[-1] < 200                           # stopped while it was reporting pages
    long_pdf = write_pdf(tmp_path / "long.pdf", book(600, {}))
    big = extract_bounded(long_pdf, memory=16 << 20)
    assert big.doc is None and big.error == "long.pdf needs more memory than a document may take (16 MiB); not read"
    assert [p for p in _spawned() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_documents_go_with_their_chat_come_back_on_undo_and_are_searched(tmp_path, book_pdf):
    store = Store(tmp_path / "chats.sqlite3")
    chat = _chat(store, "Survey questions")
    ChatDocuments(store.db, chat.id, store.doc_fts).add(ex.extract(book_pdf))
    assert [s.id for s in store.search("quillfeather")] == [chat.id]       # a word of page 150 only
    gone = store.delete_chat(chat.id)
    assert store.db.execute("SELECT COUNT(*) FROM doc_chunks").fetchone()[0] == 0
    assert store.search("quillfeather") == []
    store.restore_chat(gone)
    assert [s.id for s in store.search("quillfeather")] == [chat.id]
    store.close()
    again = Store(tmp_path / "chats.sqlite3")                  # reopened: the index checks out as it is
    assert again.doc_fts and [s.id for s in again.search("marmalade")] == [chat.id]
    again.close()


def test_an_index_lost_is_rebuilt_from_the_chunks(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    chat = _chat(store)
    (tmp_path / "n.txt").write_text("zanzibar harbour notes\n")
    ChatDocuments(store.db, chat.id, store.doc_fts).add(ex.extract(tmp_path / "n.txt"))
    store.close()
    db = sqlite3.connect(tmp_path / "chats.sqlite3")
    db.executescript("DROP TRIGGER doc_chunks_ai; DROP TRIGGER doc_chunks_ad; DROP TABLE doc_fts;")
    db.close()
    store = Store(tmp_path / "chats.sqlite3")
    assert [s.id for s in store.search("zanzibar")] == [chat.id]
    store.close()


# ---- fuzz: mutated and truncated PDFs end in text or a one-line refusal -----------------------------
FUZZ_CASES = 16
FUZZ_SECONDS = 60.0            # a read takes well under a second; 60 s is a hang


def _mutants(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    base = pdf_bytes(book(3, {2: FACT}))
    out = []
    for i in range(n):
        b = bytearray(base)
        how = i % 4
        if how == 0:                                          # cut anywhere
            b = b[:rng.randrange(1, len(b))]
        elif how == 1:                                        # random bytes flipped
            for _ in range(rng.randrange(1, 40)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif how == 2:                                        # numbers (lengths, offsets, counts) changed
            nums = [m.span() for m in re.finditer(rb"\d+", bytes(b))]
            for _ in range(rng.randrange(1, 8)):
                s, e = rng.choice(nums)
                b[s:e] = str(rng.choice([0, 1, -1, 2 ** 31, 10 ** 12, rng.randrange(10 ** 6)])).encode().rjust(e - s)[:e - s]
        else:                                                 # a slice repeated (nested, duplicated objects)
            s = rng.randrange(len(b))
            b[s:s] = b[s:s + rng.randrange(1, 4000)] * rng.randrange(1, 20)
        out.append(bytes(b))
    return out


def test_fuzzed_pdfs_end_in_text_or_a_clear_refusal(tmp_path):
    outcomes = []
    for i, data in enumerate(_mutants(20261207, FUZZ_CASES)):
        p = tmp_path / f"m{i}.pdf"
        p.write_bytes(data)
        out = extract_bounded(p, seconds=FUZZ_SECONDS)
        assert not out.cancelled
        if out.doc is None:
            assert out.error.startswith(f"m{i}.pdf") and "\n" not in out.error, (i, out.error)
            assert "takes longer" not in out.error and "stopped" not in out.error, (i, out.error)
        outcomes.append(out.doc is not None)
    assert any(outcomes) and not all(outcomes)       # the mutations reach both ends


def test_a_fork_gets_its_own_copy_of_the_documents_its_messages_name(tmp_path, store, book_pdf):
    """A fork's copied messages point at copies of its parent's documents: its prompt reads the same
    text (so the parent's K/V prefix fits it), its questions search its own chunks, and deleting the
    parent leaves them whole."""
    from app import branches
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe door code is 4711.\n")
    parent = _chat(store, "parent")
    docs = ChatDocuments(store.db, parent.id, store.doc_fts)
    whole = docs.add(ex.extract(notes))
    docs.set_mode(whole.id, WHOLE, 20)
    book = docs.add(ex.extract(book_pdf))
    docs.set_mode(book.id, PASSAGES, 120_000)
    parent.messages = [{"role": "user", "content": QUESTION, "documents": for_question(docs, QUESTION, [])},
                       {"role": "assistant", "content": "Marmalade Quillfeather [2]."}]
    store.save_chat(parent)
    fork = branches.fork(parent, 1)
    store.save_chat(fork)
    ids = docs.copy_to(fork.id)
    rename_documents(fork.messages, ids)
    theirs = ChatDocuments(store.db, fork.id, store.doc_fts)
    assert sorted(ids) == sorted([whole.id, book.id]) and not set(ids.values()) & set(ids)
    assert {s["doc"] for s in fork.messages[0]["documents"]} <= set(ids.values())
    assert expand(fork.messages, theirs.text) == expand(parent.messages, docs.text)
    store.delete_chat(parent.id)
    assert [d.name for d in theirs.documents()] == ["notes.md", "survey.pdf"]
    assert FACT in theirs.retrieve(QUESTION)[0].text.replace("\n", " ")
    assert docs.documents() == []
