"""Loading the evaluation data: JSONL files in the multi-document QA / summarization schema.

One JSON object per line::

    {"id": "...", "dataset": "hotpotqa", "question": "...",
     "passages": [{"id": "p...", "title": "...", "text": "..."}, ...],
     "answers": ["gold 1", "gold 2"]}

`passages` keep the source order and each one becomes a separately cached document `(passage id, text)`,
where text is `title + "\\n" + text` when the title is non-empty.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["Example", "load_examples", "read_jsonl", "smoke_data_path", "select_examples"]

REQUIRED_FIELDS = ("id", "dataset", "question", "passages", "answers")


@dataclass(frozen=True)
class Example:
    """One evaluation example.

    Attributes:
        id: unique example id (the resume key uses it).
        dataset: dataset name (the report groups by it).
        question: the question, or the query/instruction for summaries.
        passages: the passages as `(id, title, text)` triples, in source order.
        answers: the acceptable gold strings (one reference summary for summarization).
    """

    id: str
    dataset: str
    question: str
    passages: tuple[tuple[str, str, str], ...]
    answers: tuple[str, ...]

    @property
    def docs(self) -> list[tuple[str, str]]:
        """The documents handed to the engine: `(passage id, title + "\\n" + text)`, title only when non-empty."""
        return [(pid, f"{title}\n{text}" if title else text) for pid, title, text in self.passages]


def smoke_data_path() -> Path:
    """Path of the tiny JSONL shipped with the package (three 2WikiMultihopQA examples)."""
    return Path(str(resources.files("kvfuse") / "data" / "smoke.jsonl"))


def _parse_example(obj: object, where: str) -> Example:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("id", "dataset", "question"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise ValueError(f"{where}: field '{key}' must be a non-empty string")
    answers = obj["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings")
    passages = obj["passages"]
    if not isinstance(passages, list) or not passages:
        raise ValueError(f"{where}: field 'passages' must be a non-empty list")
    parsed = []
    for j, p in enumerate(passages):
        if not isinstance(p, dict) or "text" not in p or not isinstance(p["text"], str):
            raise ValueError(f"{where}: passages[{j}] must be an object with a string 'text'")
        title = p.get("title") or ""
        if not isinstance(title, str):
            raise ValueError(f"{where}: passages[{j}].title must be a string")
        if not (title + p["text"]).strip():
            raise ValueError(f"{where}: passages[{j}] is empty")
        pid = p.get("id")
        if not isinstance(pid, str) or not pid:
            # Same rule as the data: "p" + 16 hex of SHA-1 over title NUL text, so recurring text shares an id.
            pid = "p" + hashlib.sha1(f"{title}\0{p['text']}".encode()).hexdigest()[:16]
        parsed.append((pid, title, p["text"]))
    return Example(obj["id"], obj["dataset"], obj["question"], tuple(parsed), tuple(answers))


def read_jsonl(path: str | Path) -> list[Example]:
    """Reads a JSONL file or every `*.jsonl` of a folder (sorted by name); duplicate ids keep the first.

    Raises:
        ValueError: when the path is missing, holds no JSONL file, or a line breaks the schema.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise ValueError(f"--data {path}: folder holds no .jsonl file")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"--data {path}: no such file or folder")
    out: list[Example] = []
    seen: set[str] = set()
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f.name}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
                ex = _parse_example(obj, where)
                if ex.id in seen:
                    continue
                seen.add(ex.id)
                out.append(ex)
    if not out:
        raise ValueError(f"--data {path}: no examples found")
    return out


def _dataset_seed(seed: int, dataset: str) -> int:
    # Per-dataset stream: the selection for one dataset does not move when other datasets are added.
    return int.from_bytes(hashlib.sha256(f"{seed}:{dataset}".encode()).digest()[:8], "big")


def select_examples(examples: list[Example], datasets: list[str] | None = None, limit: int | None = None,
                    seed: int = 0, skip: int = 0) -> list[Example]:
    """Filters on dataset, shuffles each dataset deterministically by `seed`, drops the first `skip` of each and
    keeps the next `limit` (so `skip=20, limit=20` is the second twenty of each: a slice not looked at before).

    Examples are sorted by id before the shuffle, so file order does not matter. Output is grouped by dataset,
    in the order of `datasets` when given, otherwise sorted by name.

    Raises:
        ValueError: for a requested dataset that is not in the data, or a negative limit or skip.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"--skip must be an int >= 0, got {skip!r}")
    by_ds: dict[str, list[Example]] = {}
    for ex in examples:
        by_ds.setdefault(ex.dataset, []).append(ex)
    if datasets:
        unknown = [d for d in datasets if d not in by_ds]
        if unknown:
            raise ValueError(f"--datasets: unknown dataset(s) {', '.join(unknown)}; "
                             f"the data has {', '.join(sorted(by_ds))}")
        order = list(dict.fromkeys(datasets))
    else:
        order = sorted(by_ds)
    out: list[Example] = []
    for name in order:
        items = sorted(by_ds[name], key=lambda e: e.id)
        random.Random(_dataset_seed(seed, name)).shuffle(items)
        items = items[skip:]
        out.extend(items if limit is None else items[:limit])
    return out


def load_examples(path: str | Path, datasets: list[str] | None = None, limit: int | None = None,
                  seed: int = 0, skip: int = 0) -> list[Example]:
    """`read_jsonl` then `select_examples`."""
    return select_examples(read_jsonl(path), datasets=datasets, limit=limit, seed=seed, skip=skip)
