"""The capture hook (engine thread): every block's output at a prompt's last and first positions.

Used by the CaptureStates request (`strata cvec train`, engine/frontends/cvec_train.py): each block
is temporarily wrapped by a capturing module; the hidden state LEAVING block N is where llama.cpp
adds ``direction.N`` (see engine/steer/control_vector.py).
"""
from __future__ import annotations

import numpy as np
import mlx.core as mx
from engine.api import GenerateRequest
from engine.steer.steering import _layers_owner


class _Capture:
    """Wraps one block: calls it and keeps its output at the last position (float32 numpy)."""

    def __init__(self, block, store: dict, index: int):
        self.block, self.store, self.index = block, store, index

    def __call__(self, x, *args, **kwargs):
        out = self.block(x, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out      # Gemma 4: (hidden, shared K/V, offset)
        self.store[self.index] = (h[0, -1, :], h[0, 0, :])
        return out

    def __getattr__(self, key):   # use_sliding and friends, read by some model forwards
        return getattr(self.block, key)


def last_token_states(engine, prompts: list[str], progress=None, first: list | None = None) -> np.ndarray:
    """(len(prompts), n_layer, n_embd) float64: the output of every block at the last prompt token.

    ``first``, when given a list, receives the same for the FIRST prompt position (one
    (n_layer, n_embd) array per prompt). Runs on the engine thread (the CaptureStates request).
    The speed projection is switched off while it runs."""
    owner = _layers_owner(engine.model)
    layers = owner.layers
    n_layer = len(layers)
    was_on = engine.steering.speed_projection if engine.steering is not None else False
    if engine.steering is not None:
        engine.steering.speed_projection = False
    store: dict[int, object] = {}
    originals = list(layers)
    out = np.zeros((len(prompts), n_layer, engine.info.n_embd), dtype=np.float64)
    try:
        for i, block in enumerate(originals):
            layers[i] = _Capture(block, store, i)
        for k, prompt in enumerate(prompts):
            ids = engine.prompts.prompt_tokens(GenerateRequest(messages=[{"role": "user", "content": prompt}]))
            store.clear()
            engine.model(mx.array(ids)[None])
            states = [store[i] for i in range(n_layer)]
            mx.eval(states)
            for i, (last, _) in enumerate(states):
                out[k, i] = np.array(last.astype(mx.float32), dtype=np.float64)
            if first is not None:
                first.append(np.stack([np.array(f.astype(mx.float32), dtype=np.float64) for _, f in states]))
            if progress:
                progress(k + 1, len(prompts))
    finally:
        for i, block in enumerate(originals):
            layers[i] = block
        if engine.steering is not None:
            engine.steering.speed_projection = was_on
    return out
