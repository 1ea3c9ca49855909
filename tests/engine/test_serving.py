"""The serving strategy (issue 28 item 4, engine/serving.py): one interface, a local and a distributed
implementation; the engine asks it for every request and the load, and a strategy reaches no private
engine member. The distributed strategy's behaviour is tests/engine/test_distributed*.py (real ranks)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from engine import serving
from engine.ranks.distributed import Distributed
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _members(cls) -> set[str]:
    return set(getattr(cls, "__annotations__", {})) | {
        n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_both_strategies_have_every_member_of_the_interface():
    wanted = _members(serving.Serving)
    assert {"dispatch", "load_model", "distributed", "leads", "broken"} <= wanted
    for cls in (serving.LocalServing, Distributed):
        missing = {n for n in wanted if not hasattr(cls, n) and n not in getattr(cls, "__dataclass_fields__", {})}
        assert not missing, (cls.__name__, missing)
        for name in wanted:
            ours, theirs = getattr(serving.Serving, name, None), getattr(cls, name, None)
            if inspect.isfunction(ours) and inspect.isfunction(theirs):
                assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), \
                    (cls.__name__, name)


def test_no_strategy_reaches_into_a_private_engine_member():
    """`engine._x` / `eng._x` in the strategies and what they call: they drive the engine through its
    public members only (dispatch, log, require_model, the loaded model's views, conversations, guard)."""
    found = []
    for rel in ("engine/serving.py", "engine/ranks/distributed.py", "engine/ranks/pipeline_sessions.py"):
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("engine", "eng") and node.attr.startswith("_"):
                found.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


class Counting(serving.LocalServing):
    """A strategy of its own: serves locally, counting what the engine asked it."""

    def __init__(self):
        self.served: list[str] = []
        self.loads = 0

    def dispatch(self, engine, handle):
        self.served.append(type(handle.request).__name__)
        return engine.dispatch(handle)

    def load_model(self, g, dtype, progress):
        self.loads += 1
        return super().load_model(g, dtype, progress)


def test_the_engine_asks_its_strategy_for_every_request_and_the_load(tiny_gguf):
    eng = Engine(EngineOptions(model=str(tiny_gguf), cache_mib=0))
    assert isinstance(eng.serving, serving.LocalServing) and not eng.serving.distributed   # no MLX_RANK here
    counting = eng.serving = Counting()
    eng.start()
    try:
        eng.startup.result(120)
        eng.call(GenerateRequest(prompt="Hello", sampling=SamplingParams(max_tokens=4, temperature=0.0)), 120)
        eng.call(Status())
        assert counting.loads == 1
        assert counting.served == ["LoadModel", "GenerateRequest", "Status"]
    finally:
        eng.stop()
