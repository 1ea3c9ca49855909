"""The K/V identity as a value (issue 28 item 4): engine/kv_key.KVKey replaces the "model|steering[|format]"
string. The disk tier still writes that text in its segment headers (str(key)), so files written before
the type existed keep restoring: every text form the engine ever wrote parses back to the key it stood
for, and prints back to the same text."""
from __future__ import annotations

import dataclasses

import pytest

from engine.cache.kv_key import KVKey

HASH = "9f" * 16


@pytest.mark.parametrize("text, key", [
    (f"{HASH}|no-steering", KVKey(HASH)),                                  # 16-bit, no vector
    (f"{HASH}|ab12cd34|q8g64", KVKey(HASH, "ab12cd34", "q8g64")),         # steered, 8-bit
    (f"{HASH}|no-steering|q4g32", KVKey(HASH, "", "q4g32")),              # 4-bit, no vector
    (f"{HASH}|ab12cd34", KVKey(HASH, "ab12cd34")),                        # steered, 16-bit
])
def test_the_text_form_the_disk_tier_wrote_reads_back(text, key):
    assert KVKey.parse(text) == key
    assert str(key) == text
    assert key.steered == bool(key.steering)


@pytest.mark.parametrize("text", ["k", "", "|no-steering", f"{HASH}|", f"{HASH}|x|", f"{HASH}|a|b|c", None, 7])
def test_what_is_not_a_key_is_none(text):
    assert KVKey.parse(text) is None


def test_a_key_is_a_frozen_hashable_value():
    a, b = KVKey(HASH, "s", "q8g64"), KVKey(HASH, "s", "q8g64")
    assert a == b and hash(a) == hash(b) and len({a, b, KVKey(HASH)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.steering = ""                                                 # type: ignore[misc]
