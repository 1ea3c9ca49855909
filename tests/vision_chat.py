"""What the engine-side image tests share: image parts and user messages, a greedy reply, the comparison
with llama.cpp's greedy ids up to its first near-tie, and the count of images encoded."""
from __future__ import annotations

import numpy as np

from vision_images import photo, png

from engine.api import GenerateRequest, ImageInput, Status
from engine.sampling import SamplingParams
from engine.vision.images import decode_image

TIE_MARGIN = 0.6            # as tests/engine/test_oracle.py: a closer race has no single right answer


def user(*parts) -> dict:
    """A user message of text (str) and image (ImageInput) parts, in order."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return {"role": "user", "content": content}


def image(w: int, h: int, seed: int, mode: str = "RGB") -> ImageInput:
    return ImageInput(png(photo(w, h, seed=seed), mode), f"{w}x{h}.png")


def rgb(img: ImageInput) -> np.ndarray:
    return decode_image(img.data).rgb


def greedy(eng, messages, conversation: str, n: int):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=n)))


def assert_greedy_equal(ours: list[int], ref: list[int], logits: np.ndarray, margin: float = TIE_MARGIN) -> None:
    """`ours` equals llama.cpp's `ref` up to the first step where they differ, allowed only where
    llama.cpp's top-2 logits (`logits[step]`) are closer than `margin`."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(logits[i])[-2:]
            assert top2[1] - top2[0] < margin, f"step {i}: {a} vs {b}, llama.cpp margin {top2[1] - top2[0]:.3f}"
            return
    assert ours and ours == ref[:len(ours)]


def encoded(eng) -> int:
    """Images the engine has encoded since its load (Status's vision)."""
    return eng.call(Status()).vision["images_encoded"]
