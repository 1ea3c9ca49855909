"""The disk tier: conversations' K/V kept on disk across restarts."""
