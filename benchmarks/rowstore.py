"""Write benchmark results as committed rows (the schema of benchmarks/results/README.md).

A benchmark describes its run once (``run_record``) and upserts each finished row into its result file;
``python benchmarks/report.py`` then renders BENCHMARKS.md from the files. Files are written to a temporary
name and renamed into place, so an interrupted benchmark never leaves a half-written file.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1


def machine_description() -> str:
    """'<cores>-core <CPU model>, <RAM> GiB, <GPU or 'no GPU'>, torch <version>' for this host."""
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    try:
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = "memory unknown"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {cpu}, {memory}, {gpu}, torch {torch.__version__}"


def run_record(conditions: str | None = None, argv: list[str] | None = None) -> dict:
    """This process's run: its command line (``python -m benchmarks.NAME ...`` for a module run with ``-m``, else
    the script path relative to the repository), machine and date."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    module = getattr(sys.modules["__main__"].__spec__, "name", None)
    if module and script == Path(sys.modules["__main__"].__file__).resolve():
        argv[:1] = ["-m", module.removesuffix(".__main__")]
    elif script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    run = {"command": "python " + shlex.join(argv), "machine": machine_description(),
           "date": datetime.date.today().isoformat()}
    return {**run, "conditions": conditions} if conditions else run


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock on ``path``'s folder: two benchmarks running side by side each read, change and
    write a shared result file in turn, so neither drops the other's rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # closing the descriptor releases the lock


def load_file(path: Path, section: str, order: float, **fields) -> dict:
    """The result file at ``path``, or a new one with the given section, order and fields."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema must be {SCHEMA}")
        return data
    return {"schema": SCHEMA, "section": section, "order": order, **fields, "runs": {}}


def add_run(data: dict, run: dict) -> str:
    """The id of ``run`` in ``data['runs']``: an equal run's id, else a new one (its date and a counter)."""
    runs = data.setdefault("runs", {})
    for run_id, existing in runs.items():
        if existing == run:
            return run_id
    index = 1
    while f"{run['date']}-{index}" in runs:
        index += 1
    runs[f"{run['date']}-{index}"] = run
    return f"{run['date']}-{index}"


def drop_unused_runs(data: dict) -> None:
    rows = data.get("rows", []) + data.get("sweep", []) + [r for t in data.get("tables", []) for r in t["rows"]]
    used = {i for r in rows for i in ([r["run"]] if isinstance(r.get("run"), str) else r.get("run", []))}
    data["runs"] = {i: run for i, run in data.get("runs", {}).items() if i in used}


def save(path: Path, data: dict) -> None:
    drop_unused_runs(data)
    save_json(path, data, indent=1)


def save_json(path: Path, data: dict, indent: int = 2, default=None) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it into place (``default``: as
    ``json.dumps``'s, for values JSON has no type for; None refuses them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, ensure_ascii=False, default=default) + "\n")
    os.replace(tmp, path)


def replace_or_append(rows: list[dict], row: dict, same) -> list[dict]:
    """``rows`` with the first row ``same`` accepts replaced by ``row`` in place (others like it dropped), or
    with ``row`` appended: a re-measured method keeps its place in the tables."""
    hits = [i for i, r in enumerate(rows) if same(r)]
    if not hits:
        return rows + [row]
    return [row if i == hits[0] else r for i, r in enumerate(rows) if i == hits[0] or i not in hits]


def upsert_model_row(path: Path, row: dict, run: dict, *, section: str, order: float, model: str) -> dict:
    """Put ``row`` into the model file's ``sweep`` (when it has ``n``) or ``rows``, replacing the row of the
    same protocol, method (and n); the row's run becomes ``run``. Returns the file's data as written."""
    kind = "sweep" if "n" in row else "rows"
    same = ("protocol", "method", "n") if kind == "sweep" else ("protocol", "method")
    with exclusive(path):
        data = load_file(path, section, order, model=model, protocols={}, rows=[])
        row = {**row, "run": add_run(data, run)}
        data[kind] = replace_or_append(data.get(kind, []), row, lambda r: all(r.get(k) == row.get(k) for k in same))
        save(path, data)
    return data


def upsert_table_row(path: Path, title: str, row: dict, run: dict, key: str, *, section: str, order: float,
                     columns: list[dict]) -> dict:
    """Put ``row`` into the free-form table ``title`` (created with ``columns`` if missing), replacing the row
    with the same ``row[key]``. Returns the file's data as written."""
    with exclusive(path):
        data = load_file(path, section, order, tables=[])
        tables = data.setdefault("tables", [])
        table = next((t for t in tables if t["title"] == title), None)
        if table is None:
            table = {"title": title, "columns": columns, "rows": []}
            tables.append(table)
        row = {**row, "run": add_run(data, run)}
        table["rows"] = replace_or_append(table["rows"], row, lambda r: r.get(key) == row[key])
        save(path, data)
    return data
