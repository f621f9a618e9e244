"""The serving engine in eyas's loop: vLLM run from its own venv, through a worker process.

- venvs.py: the engine venvs (`eyas engines setup`), built once and cached;
- runner.py: `Engine`, one worker process and its pipe (used by capture and by serving);
- worker.py, hs_connector.py: run INSIDE the engine venv (vLLM's interpreter, never eyas's).

Capture through the engine is data/produce/engine_capture.py; serving an export and reading
vLLM's acceptance counters is train/evaluate/engine.py.
"""
