"""A chat's branches and forks, as plain functions of its message list (no Qt).

Branches: an edited question or a regenerated reply keeps what it replaced. The chat's `messages` is
the branch shown; the message where branches part carries the others as two keys of its dict (the store
keeps every key beyond role and content, app/store.py):
  SIBLINGS: one entry per alternative at this position, in the order they were made: None for the
            branch shown (this message and everything after it in `messages`), else that branch's
            messages from this position on (a list of message dicts, themselves carrying SIBLINGS
            where that branch parts again);
  BRANCH:   the index of the branch shown in SIBLINGS.
This is Open WebUI's parent/children tree held from the shown path: `tree` writes it as that model
(nodes with parentId and childrenIds, and the current leaf) for the JSON export.

Forks: `fork` makes a new chat of the history up to a message (the branch shown, without its
alternatives), its config naming where it came from (FORKED_FROM: the parent chat's id and the message
index); `fork_origin` reads that back, checked.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from .store import Chat

SIBLINGS = "siblings"
BRANCH = "branch"
KEYS = (SIBLINGS, BRANCH)
FORKED_FROM = "forked_from"        # a chat config key: {"chat": parent id, "message": index}
FORK_SUFFIX = " (fork)"


@dataclass(frozen=True)
class BranchInfo:
    """Where a message stands among its alternatives: `index` of `count` (0-based)."""
    index: int
    count: int


@dataclass(frozen=True)
class ForkOrigin:
    chat_id: str
    message: int


def _siblings(m: dict) -> tuple[list, int] | None:
    """(the alternatives, the shown one's index) when `m` holds a well-formed set, else None (a damaged
    store row is shown as a message without alternatives, never raised)."""
    sibs, k = m.get(SIBLINGS), m.get(BRANCH)
    if not isinstance(sibs, list) or len(sibs) < 2 or not isinstance(k, int) or isinstance(k, bool):
        return None
    if not 0 <= k < len(sibs) or sibs[k] is not None:
        return None
    if any(s is not None and not (isinstance(s, list) and s and all(isinstance(x, dict) for x in s))
           for i, s in enumerate(sibs) if i != k):
        return None
    return sibs, k


def info(m: dict) -> BranchInfo | None:
    """The switcher's figures for message `m` ("< 2/3 >"), None when it has no alternatives."""
    got = _siblings(m)
    return BranchInfo(got[1], len(got[0])) if got else None


def plain(m: dict) -> dict:
    """`m` without its branch keys (what a request, a fork or an export takes)."""
    return {k: v for k, v in m.items() if k not in KEYS}


def replace_tail(messages: list[dict], at: int, old_tail: list[dict]) -> None:
    """messages[at:] is a new branch that replaced `old_tail` (what messages[at:] was before an Edit or
    a Regenerate): the old branch is kept as an alternative of the new one, which is shown."""
    if not old_tail or not 0 <= at < len(messages):
        return
    first = dict(old_tail[0])
    got = _siblings(first)
    sibs, k = (list(got[0]), got[1]) if got else ([None], 0)
    sibs[k] = [plain(first)] + list(old_tail[1:])
    sibs.append(None)
    messages[at] = {**plain(messages[at]), SIBLINGS: sibs, BRANCH: len(sibs) - 1}


def switch(messages: list[dict], at: int, to: int) -> bool:
    """Show alternative `to` at position `at` (the branch and everything after it); the branch shown
    until now is kept in its place. False (nothing changed) for a position without alternatives or an
    index out of range."""
    if not 0 <= at < len(messages):
        return False
    got = _siblings(messages[at])
    if got is None or not 0 <= to < len(got[0]) or to == got[1]:
        return False
    sibs, k = list(got[0]), got[1]
    sibs[k] = [plain(messages[at])] + messages[at + 1:]
    tail = list(sibs[to])
    sibs[to] = None
    tail[0] = {**plain(tail[0]), SIBLINGS: sibs, BRANCH: to}
    messages[at:] = tail
    return True


def tree(messages: list[dict]) -> dict:
    """Every branch as Open WebUI's history: {"messages": {id: {id, parentId, childrenIds, role,
    content}}, "currentId": the shown branch's last message}. Ids are "m1", "m2"... in the order met."""
    nodes: dict[str, dict] = {}

    def add(m: dict, parent: str | None) -> str:
        nid = f"m{len(nodes) + 1}"
        nodes[nid] = {"id": nid, "parentId": parent, "childrenIds": [], "role": m.get("role", ""),
                      "content": m.get("content", "")}
        if parent is not None:
            nodes[parent]["childrenIds"].append(nid)
        return nid

    def chain(path: list[dict], parent: str | None) -> str | None:
        """Add `path` under `parent`, its alternatives beside each message; the last shown node."""
        for m in path:
            got = _siblings(m)
            here = None
            for i, alt in enumerate(got[0] if got else [None]):
                if alt is None:
                    here = add(m, parent)
                else:
                    chain(alt, parent)
            parent = here
        return parent

    current = chain(messages, None)
    return {"messages": nodes, "currentId": current}


def fork(parent: Chat, index: int) -> Chat:
    """A new chat holding `parent`'s messages up to and including `index` (the branch shown, without
    alternatives), titled "<parent title> (fork)", with the parent's config (its steering, so the K/V
    is the same) and FORKED_FROM. A session file the parent was restored from is not the fork's."""
    index = max(0, min(index, len(parent.messages) - 1))
    messages = [plain(copy.deepcopy(m)) for m in parent.messages[:index + 1]]
    config = {k: copy.deepcopy(v) for k, v in parent.config.items() if k != "session"}
    config[FORKED_FROM] = {"chat": parent.id, "message": index}
    return Chat(title=parent.title + FORK_SUFFIX, messages=messages, config=config)


def fork_origin(config: dict) -> ForkOrigin | None:
    """The parent a chat was forked from (its config's FORKED_FROM, checked), or None."""
    got = config.get(FORKED_FROM)
    if not isinstance(got, dict):
        return None
    cid, n = got.get("chat"), got.get("message")
    if not isinstance(cid, str) or not cid or not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    return ForkOrigin(cid, n)
