"""What a conversation's K/V depends on: the model's content, the steering applied to it and the K/V
format. K/V is only ever reused, parked, restored or saved under an equal key (plain Python).

Was a "model|steering[|format]" string split apart again where a part was needed; the string is still
what the disk tier's segment headers hold (`str(key)`, read back by `KVKey.parse`), so segments written
before this type existed keep restoring.
"""
from __future__ import annotations

from dataclasses import dataclass

NO_STEERING = "no-steering"     # the steering part of the text form when no vector is applied
PLAIN_FORMAT = "float16"        # kv_format.KVFormat.label of 16-bit K/V (not written in the text form)


@dataclass(frozen=True)
class KVKey:
    model_hash: str                 # gguf_file.set_hash of the model (a split model: every part)
    steering: str = ""              # the applied control vector's fingerprint; "" when none is applied
    kv_format: str = PLAIN_FORMAT   # kv_format.KVFormat.label: "float16", "q8g64", "q4g32", ...

    @property
    def steered(self) -> bool:
        return bool(self.steering)

    def __str__(self) -> str:
        """The text form the disk tier writes: model|steering, then |format for quantized K/V."""
        return (f"{self.model_hash}|{self.steering or NO_STEERING}"
                + ("" if self.kv_format == PLAIN_FORMAT else f"|{self.kv_format}"))

    @classmethod
    def parse(cls, text: object) -> "KVKey | None":
        """The key of a text form (None when `text` is not one: a foreign or damaged header)."""
        if not isinstance(text, str):
            return None
        parts = text.split("|")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and not parts[2]):
            return None
        steering = "" if parts[1] == NO_STEERING else parts[1]
        return cls(parts[0], steering, parts[2] if len(parts) == 3 else PLAIN_FORMAT)
