"""Turning a prompt into tokens: prefill, the decode loop, batching, speculation, grammar constraints."""
