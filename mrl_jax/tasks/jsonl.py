"""A user's local JSONL of (prompt, answer) records, with answer extraction and tolerant comparison.

Answer extraction (:func:`extract_answer`), tried in order (configurable):

* ``"hash"``   -- the text after the last ``####`` (GSM8K), up to the end of its line;
* ``"boxed"``  -- the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced);
* ``"last_number"`` -- the last number in the text (``-1,234.5``, ``.5``, ``3/4``).

Comparison (:func:`answers_match`): when both sides parse as numbers (:func:`parse_number`:
``"1,000"``, ``"$1000"``, ``"3.0"``, ``"\\frac{3}{4}"``, ``"50%"``) they are compared numerically
(relative tolerance 1e-6); when only the reference is a number, the first number of the extracted
answer is used (``"72 clips"``, ``"x = 5"``); otherwise they are compared as whitespace-normalised strings.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence

from .base import INT32_MAX, Prompt, SFTExample, Task, hash_unit

__all__ = [
    "JsonlFormatError",
    "JsonlTask",
    "answers_match",
    "extract_answer",
    "extract_boxed",
    "extract_hash",
    "extract_last_number",
    "load_jsonl",
    "parse_number",
]

DEFAULT_FORMATS = ("hash", "boxed", "last_number")
JSONL_ID_BASE = 1_000_000_000


class JsonlFormatError(ValueError):
    """A JSONL file has a bad line; the message names the file and the 1-based line number."""


# ----------------------------------------------------------------------------------------- extraction
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def extract_hash(text: str) -> str | None:
    """Text after the last ``####`` up to the end of that line, stripped; None when absent or empty."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    out = text[pos + 4 :].strip().split("\n", 1)[0].strip()
    return out or None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with nested braces; None if absent/unclosed."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1].strip()
    return best


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands commas, decimals, simple fractions); None if none."""
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


_EXTRACTORS = {"hash": extract_hash, "boxed": extract_boxed, "last_number": extract_last_number}


def extract_answer(text: str, formats: Sequence[str] = DEFAULT_FORMATS) -> str | None:
    """The first answer found by the extractors named in ``formats`` (in order); None when none matches."""
    for f in formats:
        try:
            fn = _EXTRACTORS[f]
        except KeyError:
            raise ValueError(f"unknown answer format {f!r}; choose from {sorted(_EXTRACTORS)}") from None
        out = fn(text)
        if out is not None:
            return out
    return None


# ------------------------------------------------------------------------------------------ compare
_FRAC_RE = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_PLAIN_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
_GROUPED_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def parse_number(s: str) -> float | None:
    """``s`` as a number, tolerant of formatting; None when it is not one.

    Accepts surrounding whitespace / ``$`` / ``\\$`` / a trailing ``.`` or ``%``, thousands commas in
    proper groups (``"1,000"``; ``"1,00"`` is not a number), LaTeX ``{,}`` and ``\\!`` separators,
    ``"3/4"`` and ``\\frac{3}{4}``.
    """
    t = s.strip()
    t = t.replace("\\!", "").replace("{,}", ",").replace("\\$", "").replace("$", "").replace("\\%", "%")
    t = t.strip().rstrip(".").rstrip("%").strip()
    if t.startswith("{") and t.endswith("}"):
        t = t[1:-1].strip()
    if not t:
        return None
    m = _FRAC_RE.match(t)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return None if num is None or den in (None, 0.0) else num / den
    if "/" in t:
        a, _, b = t.partition("/")
        num, den = parse_number(a), parse_number(b)
        return None if num is None or den in (None, 0.0) else num / den
    if _GROUPED_RE.match(t):
        t = t.replace(",", "")
    if not _PLAIN_RE.match(t):
        return None
    try:
        v = float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _norm_text(s: str) -> str:
    s = " ".join(s.strip().split())
    if s.startswith("$") and s.endswith("$") and len(s) > 1:
        s = s.strip("$").strip()
    return s.rstrip(".").strip()


def answers_match(pred: str | None, gold: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """True when ``pred`` equals ``gold``: numerically if ``gold`` is a number (``pred``'s first number
    when ``pred`` is not one), else as whitespace-normalised strings (surrounding ``$`` / final ``.`` ignored)."""
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(gold)
    if b is not None and a is None:  # "72 clips", "x = 5": the first number of the extracted answer
        m = _NUMBER_RE.search(pred)
        a = parse_number(m.group(0)) if m else None
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    return _norm_text(pred) == _norm_text(gold)


# --------------------------------------------------------------------------------------------- load
def _field(record: dict, name: str, path: str, lineno: int) -> Any:
    if name not in record:
        raise JsonlFormatError(
            f"{path}:{lineno}: missing field {name!r} (fields present: {sorted(record)[:10]})"
        )
    return record[name]


def _as_text(value: Any, name: str, path: str, lineno: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JsonlFormatError(
            f"{path}:{lineno}: field {name!r} must be a string or a number, got {type(value).__name__}"
        )
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    id_field: str | None = None,
) -> list[dict]:
    """Read ``path``: one JSON object per non-blank line.

    Returns ``[{"prompt": str, "answer": str, "id": <id_field value or None>, "line": int, "record": dict}]``.
    Raises :class:`JsonlFormatError` naming ``path:line`` for invalid JSON, a non-object line, a missing
    field, a field of the wrong type, a line that is not UTF-8 or an empty file, and FileNotFoundError for a
    missing one.
    """
    path = os.fspath(path)
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlFormatError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                       f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlFormatError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise JsonlFormatError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            prompt = _as_text(_field(record, prompt_field, path, lineno), prompt_field, path, lineno)
            answer = _as_text(_field(record, answer_field, path, lineno), answer_field, path, lineno)
            rid = None
            if id_field is not None:
                rid = _field(record, id_field, path, lineno)
                if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0:
                    raise JsonlFormatError(f"{path}:{lineno}: field {id_field!r} must be a non-negative integer")
            rows.append({"prompt": prompt, "answer": answer, "id": rid, "line": lineno, "record": record})
    if not rows:
        raise JsonlFormatError(f"{path}: no records (empty file)")
    return rows


class JsonlTask(Task):
    """Prompts and reference answers from a local JSONL file.

    The stored ``Prompt.answer`` is the reference answer extracted with ``formats`` when the answer field
    contains a ``####`` / ``\\boxed{}`` marker (GSM8K style), else the field stripped; the raw field is in
    ``meta["raw_answer"]``. :meth:`verify` extracts the answer from the completion with ``formats`` and
    compares with :func:`answers_match`. Records are split into train / held-out by a seeded hash of the
    prompt text (so duplicated prompts land on the same side).

    Args:
      path: the JSONL file.
      prompt_field, answer_field: field names of the prompt and of the reference answer.
      id_field: optional field holding a non-negative integer id (added to ``id_base``); default: the
        record's index among non-blank lines.
      heldout_fraction: expected fraction of records held out.
      seed: seed of the hash split.
      formats: answer extractors for completions (see :func:`extract_answer`).
      name: task name.
      id_base: first id (default 1_000_000_000; give distinct bases to several files in one mixture).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        id_field: str | None = None,
        heldout_fraction: float = 0.1,
        seed: int = 0,
        formats: Sequence[str] = DEFAULT_FORMATS,
        name: str = "jsonl",
        id_base: int = JSONL_ID_BASE,
    ):
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"JsonlTask: heldout_fraction must be in [0, 1), got {heldout_fraction}")
        for f in formats:
            if f not in _EXTRACTORS:
                raise ValueError(f"JsonlTask: unknown answer format {f!r}; choose from {sorted(_EXTRACTORS)}")
        self.path, self.name = os.fspath(path), name
        self.prompt_field, self.answer_field, self.id_field = prompt_field, answer_field, id_field
        self.heldout_fraction, self.seed = float(heldout_fraction), int(seed)
        self.formats, self.id_base = tuple(formats), int(id_base)

    def _build(self):
        rows = load_jsonl(
            self.path, prompt_field=self.prompt_field, answer_field=self.answer_field, id_field=self.id_field
        )
        train, ev, seen = [], [], {}
        for idx, row in enumerate(rows):
            local = idx if row["id"] is None else row["id"]
            pid = self.id_base + local
            if pid > INT32_MAX:
                raise JsonlFormatError(f"{self.path}:{row['line']}: prompt id {pid} does not fit in int32")
            if pid in seen:
                raise JsonlFormatError(f"{self.path}:{row['line']}: duplicate id {local} (also line {seen[pid]})")
            seen[pid] = row["line"]
            raw = row["answer"]
            gold = raw.strip()
            if "####" in raw or "\\boxed" in raw or "\\fbox" in raw:
                gold = extract_answer(raw, ("hash", "boxed")) or gold
            split = "eval" if hash_unit(row["prompt"], self.seed) < self.heldout_fraction else "train"
            p = Prompt(
                id=pid,
                text=row["prompt"],
                answer=gold,
                task=self.name,
                meta={"raw_answer": raw, "line": row["line"], "split": split},
            )
            (ev if split == "eval" else train).append(p)
        if not train:
            raise ValueError(f"{self.path}: every record was held out; lower heldout_fraction")
        return train, ev

    def verify(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if answers_match(extract_answer(completion, self.formats), prompt.answer) else 0.0

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        """Train records with their *raw* answer field (full solutions where the file has them)."""
        if part is not None:
            raise ValueError(f"task {self.name!r} has no parts")
        self._ensure()
        return [SFTExample(p.text, p.meta["raw_answer"]) for p in self._train]
