"""A repetition penalty over an image prompt, in each decoder (a lone reply, a batch row, lookup
speculation): its context is the prompt's text ids and the reply, never an image's ids. An image id
indexes no row of the logits and MLX's gather does not check bounds: with a question shorter than the
penalty's window after an image, the window read and wrote outside the logits and the app crashed
(SIGSEGV in mlx::core::gather) at a chat's first decode step."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

import llama_oracle
from gguf_factory_vision import write_gemma3_vision_pair

from engine.api import GenerateRequest
from engine.sampling import SamplingParams
from engines import maker
from vision_chat import image, user

SEEN: list[int] = []        # the least token id in each context the penalty was given


@dataclass
class Watched(SamplingParams):
    """The request's own processors (mlx-lm's repetition penalty), with the least id of each context
    they get noted first."""

    def processors(self):
        inner = super().processors()

        def watch(tokens, logits):
            SEEN.append(int(tokens.min().item()))
            for p in inner:
                logits = p(tokens, logits)
            return logits
        return [watch]


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    llama_oracle.require()
    model, _ = write_gemma3_vision_pair(tmp_path_factory.mktemp("penalty"))
    with maker(model, cache_mib=256) as m:
        yield m


def ask(eng, conversation: str, speculative: str = "off"):
    SEEN.clear()
    # "Hi" after the image: the prompt's text after it is a few tokens, under the penalty's 20
    msgs = [user(image(96, 64, 3), "Hi")]
    return eng.call(GenerateRequest(messages=msgs, conversation=conversation, speculative=speculative,
                                    sampling=Watched(temperature=0.0, repetition_penalty=1.5, max_tokens=24)))


@pytest.mark.parametrize("path,options,speculative", [
    ("lone", {"max_sequences": 1}, "off"),
    ("batch row", {"max_sequences": 4}, "off"),
    ("lookup", {"max_sequences": 1}, "lookup"),
])
def test_penalty_context_holds_no_image_ids(make, path, options, speculative):
    r = ask(make(**options), path, speculative)
    assert r.generated_tokens == 24
    assert SEEN and min(SEEN) >= 0, f"{path}: the penalty was given an image id ({min(SEEN)})"


def test_reply_is_the_same_in_every_decoder(make):
    replies = {opts: ask(make(max_sequences=opts[0]), f"same-{opts}", opts[1]).tokens
               for opts in [(1, "off"), (4, "off"), (1, "lookup")]}
    assert len(set(map(tuple, replies.values()))) == 1, replies
