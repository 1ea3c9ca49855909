"""The memory bound of a child process the app starts to read untrusted files (the model list's header
reader, the documents' reader): RLIMIT_AS where the system enforces it (Linux). Elsewhere (macOS does
not enforce RLIMIT_AS) the app's watch of the child's RSS is the bound."""
from __future__ import annotations

import sys


def limit_address_space(limit: int) -> str | None:
    """This process's address space capped at `limit` bytes more than it is now (a spawned child has
    imported the app's main module, Qt included, before it gets here); why not, or None."""
    if not sys.platform.startswith("linux"):
        return None
    import resource    # lazy: Unix only, and only the children need it
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (now + limit, now + limit))
    except (ValueError, OSError) as e:
        return str(e)
    return None
