"""Session files: a conversation's tokens and K/V saved and restored."""
