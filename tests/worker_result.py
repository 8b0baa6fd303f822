"""The one JSON result of a test's child process, passed through a file rather than stdout.

C++ libraries the children load (gloo under ``jax.distributed``) write to the same stdout from their own threads,
so a JSON line there can come back with their text spliced into it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "MRL_WORKER_RESULT"


def write(result: dict) -> None:
    """In the child: the result into the file named by ``$MRL_WORKER_RESULT`` (printed when it is unset)."""
    text = json.dumps(result, default=str)
    path = os.environ.get(ENV)
    if path is None:
        print(text, flush=True)
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def env_for(env: dict, path: Path) -> dict:
    """``env`` for a child that writes its result to ``path``."""
    return dict(env, **{ENV: str(path)})


def read(path: Path, stdout: str = "") -> dict:
    """The result a child wrote to ``path`` (its stdout in the message when it wrote none)."""
    assert path.exists(), f"the worker wrote no result to {path}; its stdout ended:\n{stdout[-2000:]}"
    return json.loads(path.read_text())
