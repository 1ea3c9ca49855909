"""Front ends over the engine: `strata` (cli.py), the OpenAI-compatible server (server.py), JSONL
replay (replay.py), `strata cvec train` (cvec_train.py); launch.py starts an engine for them.

They use the engine only through engine/api.py's requests and results (and Engine.submit/call);
nothing in the engine core imports them.
"""
