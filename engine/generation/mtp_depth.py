"""What both MTP drafters (engine/generation/mtp_spec.py's NextN head, engine/generation/gemma4_mtp_spec.py's Gemma 4 drafter)
share: how many tokens they draft per verify pass, and where the target's cache stands."""
from __future__ import annotations

# Tokens drafted per verify pass. Drafts beyond the first chain the head on its own output (what it was
# not trained on), so acceptance falls with depth; on the CPU a verify pass over k+1 tokens costs more
# than one over 1 (engine/generation/speculative.py's LOOKUP_DRAFT_CPU note), so drafts stay short there.
MTP_DRAFT_GPU = 3
MTP_DRAFT_CPU = 2


def target_offset(cache) -> int:
    """Tokens the target's cache holds (its full-attention layers' offset)."""
    for c in cache or ():
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    raise RuntimeError("the target's cache has no attention layer to count positions by")
