"""A task over a local dataset read by Hugging Face ``datasets`` (never the hub).

Inputs: a parquet / jsonl / json / csv / arrow file, or a ``save_to_disk`` directory (``Dataset`` or
``DatasetDict``). Both of TRL's formats: *standard* (the prompt column is a string) and *conversational*
(a list of ``{role, content}`` messages: an optional system turn, then one user turn). A task-level
``system_prompt`` or a conversation's system turn is written before the user text, separated by a blank
line (a policy's own ``system_prompt`` is its chat template's system turn).

Every column other than the prompt reaches reward functions as a keyword argument, as in TRL
(``Prompt.meta["columns"]``). A prompt's id is ``id_base + row`` for the training file and
``id_base + EVAL_OFFSET + row`` for an ``eval_path`` file (or the ``id_field`` column's integer), so ids
are a function of the files' contents and row positions only. ``eval_fraction`` holds out rows by a
seeded hash of the prompt text (repeated prompts land on one side).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import INT32_MAX, Prompt, SFTExample, Task, hash_unit
from .verifiers import VerifierReward, get_verifier

__all__ = ["DATASET_ID_BASE", "DatasetError", "DatasetTask", "load_local_dataset"]

DATASET_ID_BASE = 1_200_000_000
EVAL_OFFSET = 500_000
FORMATS = ("auto", "json", "jsonl", "parquet", "csv", "arrow")
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")   # TRL's reward kwargs; columns follow them
_EXT = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


class DatasetError(ValueError):
    """A dataset file cannot serve as a task; the message names the file and the fix."""


def _builder(path: str, fmt: str) -> str:
    if fmt != "auto":
        return "json" if fmt == "jsonl" else fmt
    ext = Path(path).suffix.lower()
    if ext not in _EXT:
        raise DatasetError(f"{path}: cannot tell the format from the extension {ext!r}; set task.format to one of "
                           f"{list(FORMATS[1:])}")
    return _EXT[ext]


def load_local_dataset(path: str | os.PathLike, fmt: str = "auto", split: str | None = None):
    """The ``datasets.Dataset`` at ``path`` (a file, or a ``save_to_disk`` directory; ``split`` picks one
    split of a ``DatasetDict``, default ``train``)."""
    import datasets

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:  # noqa: BLE001
            raise DatasetError(f"{path}: not a save_to_disk directory ({type(e).__name__}: {str(e)[:200]})") from None
        if isinstance(ds, datasets.DatasetDict):
            name = split or "train"
            if name not in ds:
                raise DatasetError(f"{path}: no split {name!r} (splits: {sorted(ds)}); set task.split")
            return ds[name]
        return ds
    builder = _builder(path, fmt)
    if builder in ("json", "csv") and not _has_text(path):
        raise DatasetError(f"{path}: the file is empty (no rows); give a file with one row per prompt")
    bad = _bad_json_line(path) if builder == "json" else None
    if bad:   # datasets' own message has no line number (and logs a traceback)
        raise DatasetError(f"{path}:{bad}")
    bars_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()   # no "Generating train split" bars on stderr
    try:
        if builder == "arrow":
            return datasets.Dataset.from_file(path)
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 -- pyarrow / json errors: one line naming the file
        if "corresponds to no data" in str(e):
            raise DatasetError(f"{path}: the split has no rows") from None
        raise DatasetError(f"{path}: could not be read as {builder} ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        if not bars_off:
            datasets.enable_progress_bars()


def _has_text(path: str) -> bool:
    """Whether the file holds anything but whitespace."""
    with open(path, "rb") as fh:
        return any(chunk.strip() for chunk in iter(lambda: fh.read(1 << 16), b""))


def _bad_json_line(path: str) -> str | None:
    """``"LINE: why"`` of the first line of a JSON-lines file that is not one JSON object (None: every line is,
    or the file is one JSON document)."""
    import json

    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:
                if lineno == 1 and raw.lstrip()[:1] == b"[":
                    return None   # a JSON array document, not JSON lines
                return f"{lineno}: invalid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})"
            if not isinstance(record, dict):
                return f"{lineno}: expected a JSON object per line, got {type(record).__name__}"
    return None


def _text(value: Any, key: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DatasetError(f"{where}: column {key!r} must be text or a number, got {type(value).__name__}")
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _prompt_text(value: Any, key: str, where: str, system_prompt: str | None) -> tuple[str, str | None]:
    """``(user text, system text)`` of a standard (string) or conversational (messages) prompt."""
    if isinstance(value, str):
        return value, system_prompt
    ok = isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   for m in value)
    roles = [m.get("role") for m in value] if ok else []
    if not ok or roles not in (["user"], ["system", "user"]):
        raise DatasetError(f"{where}: column {key!r} must be a string (standard format) or messages "
                           f"[{{role: system}}?, {{role: user}}] (conversational), got {str(value)[:80]!r}")
    system = value[0]["content"] if roles[0] == "system" else system_prompt
    return value[-1]["content"], system


class DatasetTask(Task):
    """Prompts and reference answers from a local dataset, scored by a verifier (see the module docstring).

    Args:
      path: the file or ``save_to_disk`` directory.
      format: ``auto`` (from the extension) or one of ``json jsonl parquet csv arrow``.
      split: split of a ``DatasetDict`` directory (default ``train``).
      prompt_field, answer_field: the prompt and reference-answer columns.
      eval_path / eval_split / eval_fraction: held-out rows from another file, another split of the
        directory, or a seeded hash fraction of the training rows (at most one of the three).
      system_prompt: text written before every prompt (a conversation's own system turn wins).
      verifier: ``math_verify`` | ``gsm8k`` | ``exact``.
      id_field: optional integer column giving the ids (added to ``id_base``); duplicates are an error.
    """

    def __init__(self, path, *, format: str = "auto", split: str | None = None, prompt_field: str = "prompt",
                 answer_field: str = "answer", eval_path=None, eval_split: str | None = None,
                 eval_fraction: float = 0.0, system_prompt: str | None = None, verifier: str = "math_verify",
                 id_field: str | None = None, seed: int = 0, name: str = "dataset", id_base: int = DATASET_ID_BASE):
        if format not in FORMATS:
            raise DatasetError(f"task.format {format!r}: choose from {list(FORMATS)}")
        if sum(x is not None and x != 0 for x in (eval_path, eval_split, eval_fraction)) > 1:
            raise DatasetError("give at most one of task.eval_path, task.eval_split, task.eval_fraction")
        if not 0.0 <= eval_fraction < 1.0:
            raise DatasetError(f"task.eval_fraction must be in [0, 1), got {eval_fraction}")
        self.path, self.format, self.split, self.name = os.fspath(path), format, split, name
        self.prompt_field, self.answer_field, self.id_field = prompt_field, answer_field, id_field
        self.eval_path = None if eval_path is None else os.fspath(eval_path)
        self.eval_split, self.eval_fraction = eval_split, float(eval_fraction)
        self.system_prompt, self.seed, self.id_base = system_prompt, int(seed), int(id_base)
        self.verifier = get_verifier(verifier)
        self.heldout_disjoint = True
        #: the accuracy reward: picklable, run in worker processes (see mrl_jax.tasks.verifiers on time limits)
        self.reward_fn, self.reward_isolation = VerifierReward(verifier), "process"

    def _rows(self, ds, path: str, offset: int) -> list[Prompt]:
        cols = list(ds.column_names)
        for key in (self.prompt_field, self.answer_field, self.id_field):
            if key is not None and key not in cols:
                raise DatasetError(f"{path}: no column {key!r} (columns: {cols}); set task.prompt_field / "
                                   "task.answer_field / task.id_field to one of them")
        shadow = [c for c in cols if c in REWARD_ARGUMENTS and c != self.prompt_field]
        if shadow:
            raise DatasetError(f"{path}: column {shadow[0]!r} has the name of a reward function argument (TRL passes "
                               "prompts, completions, completion_ids, then every other column as a keyword), so every "
                               f"reward call would fail; rename the column (e.g. {shadow[0]}_ref)")
        if len(ds) == 0:
            raise DatasetError(f"{path}: the split has no rows")
        if len(ds) > EVAL_OFFSET:
            raise DatasetError(f"{path}: {len(ds)} rows; at most {EVAL_OFFSET} rows per file are supported")
        out = []
        for i, row in enumerate(ds):
            where = f"{path} row {i}"
            user, system = _prompt_text(row[self.prompt_field], self.prompt_field, where, self.system_prompt)
            text = f"{system}\n\n{user}" if system else user
            local = offset + i
            if self.id_field is not None:
                local = row[self.id_field]
                if isinstance(local, bool) or not isinstance(local, int) or local < 0:
                    raise DatasetError(f"{where}: column {self.id_field!r} must be a non-negative integer")
            pid = self.id_base + local
            if pid > INT32_MAX:
                raise DatasetError(f"{where}: prompt id {pid} does not fit in int32; lower the ids or id_base")
            columns = {k: v for k, v in row.items() if k != self.prompt_field}
            out.append(Prompt(id=pid, text=text, answer=_text(row[self.answer_field], self.answer_field, where),
                              task=self.name, meta={"columns": columns, "row": i, "file": path}))
        return out

    def _build(self):
        train = self._rows(load_local_dataset(self.path, self.format, self.split), self.path, 0)
        if self.eval_path is not None:
            ev = self._rows(load_local_dataset(self.eval_path, self.format), self.eval_path, EVAL_OFFSET)
        elif self.eval_split is not None:
            ev = self._rows(load_local_dataset(self.path, self.format, self.eval_split),
                            f"{self.path}[{self.eval_split}]", EVAL_OFFSET)
        else:
            held = [hash_unit(p.text, self.seed) < self.eval_fraction for p in train]
            rows, ev = train, [p for p, h in zip(train, held) if h]
            train = [p for p, h in zip(train, held) if not h]
            if not train or (self.eval_fraction > 0 and not ev):
                raise DatasetError(self._split_problem(rows, bool(ev)))
        seen: dict[int, str] = {}
        for p in train + ev:
            where = f"{p.meta['file']} row {p.meta['row']}"
            if p.id in seen:
                raise DatasetError(f"{where}: duplicate prompt id {p.id - self.id_base} (also {seen[p.id]}); "
                                   "make the id column unique")
            seen[p.id] = where
        return train, ev

    def _split_problem(self, rows: list[Prompt], held: bool) -> str:
        """Why the ``eval_fraction`` hash split left one side empty (``held``: the rows all went to eval):
        repeated prompts (a prompt's copies share one side, so few distinct prompts split coarsely) or the
        fraction itself, and the fix."""
        side = "held out (none left to train on)" if held else "kept for training (none held out)"
        first: dict[str, int] = {}
        for p in rows:
            first.setdefault(p.text, p.meta["row"])
        if len(first) < len(rows):
            repeats = [p.meta["row"] for p in rows if first[p.text] != p.meta["row"]]
            shown = ", ".join(map(str, repeats[:5])) + (", ..." if len(repeats) > 5 else "")
            return (f"{self.path}: every row was {side} by task.eval_fraction {self.eval_fraction}: the {len(rows)} "
                    f"rows hold only {len(first)} distinct prompts (rows {shown} repeat an earlier row's prompt), and "
                    "the split keeps a prompt's copies on one side; remove the duplicate rows, or give the held-out "
                    "rows in task.eval_path")
        fix = "lower task.eval_fraction" if held else "raise task.eval_fraction"
        return (f"{self.path}: every row was {side} by task.eval_fraction {self.eval_fraction} ({len(rows)} rows); "
                f"{fix}, or give the held-out rows in task.eval_path")

    def verify(self, prompt: Prompt, completion: str) -> float:
        return self.verifier.score(completion, prompt.answer)

    def answer_key(self, prompt: Prompt, completion: str) -> str | None:
        """The completion's answer as majority voting compares it (None: no answer found)."""
        return self.verifier.answer_key(completion)

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        if part is not None:
            raise ValueError(f"task {self.name!r} has no parts")
        self._ensure()
        return [SFTExample(p.text, p.answer) for p in self._train]
