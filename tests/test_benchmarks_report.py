"""BENCHMARKS.md is what benchmarks/report.py renders from the committed rows, every table names its runs,
and the tables and plots follow the data (a new method row appears without a code change)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import compare_methods, report, rowstore
from tests.test_repo_language import WORK_WORDS

ROOT = Path(__file__).resolve().parents[1]

RUN_ENTRY = re.compile(r"^- (\*\*([a-z]+)\*\*: )?`[^`]+`; machine: [^;]+; date: \d{4}-\d{2}-\d{2}")


def tables_with_runs(page: str) -> list[tuple[list[str], list[str]]]:
    """Each markdown table of the page with the run entries listed after it (before the next heading)."""
    lines, found, i = page.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            table, entries = lines[start:i], []
            j = i
            while j < len(lines) and not lines[j].startswith("#") and not lines[j].startswith("|"):
                if lines[j] in ("Run:", "Runs:"):
                    k = j + 2
                    while k < len(lines) and lines[k].startswith("- "):
                        entries.append(lines[k])
                        k += 1
                    break
                j += 1
            found.append((table, entries))
        i += 1
    return found


def test_page_is_the_render_of_the_committed_rows():
    rendered = report.render(report.load(report.ROWS))
    assert (ROOT / "BENCHMARKS.md").read_text() == rendered, "run: python benchmarks/report.py"
    assert report.main(["--check"]) == 0


def test_every_table_names_command_machine_and_date():
    page = (ROOT / "BENCHMARKS.md").read_text()
    tables = tables_with_runs(page)
    assert len(tables) >= 20
    for table, entries in tables:
        assert entries, f"table without runs: {table[0]}"
        assert all(RUN_ENTRY.match(e) for e in entries), entries
        header = [c.strip() for c in table[0].strip("|").split("|")]
        if header[-1] == "run":   # every letter in the run column is listed below the table
            column = len(header) - 1
            listed = {RUN_ENTRY.match(e).group(2) for e in entries}
            used = {letter.strip() for row in table[2:] for letter in row.strip("|").split("|")[column].split(",")}
            assert used <= listed, (table[0], used - listed)


def test_page_speaks_to_users():
    page = (ROOT / "BENCHMARKS.md").read_text()
    assert not WORK_WORDS.search(page), WORK_WORDS.search(page).group()  # the repository-wide rule
    for pattern in (r"/work/", r"/root/", r"\bround \d"):  # machine-local paths; no numbered round at all
        assert not re.search(pattern, page, re.IGNORECASE), pattern
    headings = [line for line in page.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)), "one table per question: a heading appears twice"


def copy_rows(tmp_path: Path) -> Path:
    rows = tmp_path / "results"
    shutil.copytree(report.ROWS, rows, ignore=shutil.ignore_patterns("README.md"))
    return rows


def quality_section(page: str, model: str) -> str:
    start = page.index(f"## {model}")
    return page[start:page.index("\n## ", start + 1)]


def test_a_new_method_row_appears_in_quality_cost_and_plot(tmp_path):
    rows = copy_rows(tmp_path)
    run = {"command": "python -m benchmarks.compare_methods --model qwen2.5-0.5b --only NewMethod",
           "machine": "test machine", "date": "2026-11-25"}
    row = {"protocol": "held-out", "method": "NewMethod", "layers": 19, "params_pct": 88.2,
           "ppl": {"wikitext2": 40.12, "c4": 70.5, "code": 7.1}, "compress_s": 321}
    rowstore.upsert_model_row(rows / "quality_qwen2_5_0_5b.json", row, run, section="Qwen2.5-0.5B", order=20,
                              model="qwen2.5-0.5b")
    page = report.render(report.load(rows))
    section = quality_section(page, "Qwen2.5-0.5B")
    lines = [line for line in section.splitlines() if "| NewMethod |" in line]
    assert len(lines) == 2                                  # quality and cost tables
    assert "**40.12**" in lines[0] and "70.50" in lines[0]  # the new best held-out WikiText-2 PPL is marked
    assert "| 321 |" in lines[1]
    assert f"`{run['command']}`; machine: test machine; date: 2026-11-25" in section
    assert (88.2, 40.12) in report.plot_points(json.loads((rows / "quality_qwen2_5_0_5b.json").read_text()))[
        "held-out"]["NewMethod"]
    assert page.replace(section, "") == report.render(report.load(report.ROWS)).replace(
        quality_section(report.render(report.load(report.ROWS)), "Qwen2.5-0.5B"), "")   # nothing else moved


def test_upsert_replaces_in_place_and_drops_unused_runs(tmp_path):
    path = tmp_path / "quality_x.json"
    first = {"command": "python a.py", "machine": "m", "date": "2026-01-01"}
    second = {"command": "python b.py", "machine": "m", "date": "2026-01-02"}
    for method in ("dense", "A", "B"):
        rowstore.upsert_model_row(path, {"protocol": "p", "method": method, "layers": 2, "params_pct": 100.0,
                                         "ppl": {"wikitext2": 1.0}}, first, section="X", order=1, model="x")
    data = rowstore.upsert_model_row(path, {"protocol": "p", "method": "A", "layers": 1, "params_pct": 50.0,
                                            "ppl": {"wikitext2": 2.0}}, second, section="X", order=1, model="x")
    assert [r["method"] for r in data["rows"]] == ["dense", "A", "B"]
    assert data["rows"][1]["ppl"] == {"wikitext2": 2.0} and data["rows"][1]["run"] == "2026-01-02-1"
    for method in ("dense", "B"):
        rowstore.upsert_model_row(path, {"protocol": "p", "method": method, "layers": 2, "params_pct": 100.0,
                                         "ppl": {"wikitext2": 3.0}}, second, section="X", order=1, model="x")
    assert set(json.loads(path.read_text())["runs"]) == {"2026-01-02-1"}
    sweep = rowstore.upsert_model_row(path, {"protocol": "p", "method": "A", "n": 1, "layers": 1,
                                             "params_pct": 50.0, "ppl": {"wikitext2": 5.0}}, second,
                                      section="X", order=1, model="x")
    assert len(sweep["rows"]) == 3 and sweep["sweep"][0]["n"] == 1


def test_check_fails_when_the_page_drifts(tmp_path, capsys):
    rows = copy_rows(tmp_path)
    page, images = tmp_path / "BENCHMARKS.md", str(report.IMAGES)
    assert report.main(["--rows", str(rows), "--out", str(page), "--no-plots"]) == 0
    assert report.main(["--check", "--rows", str(rows), "--out", str(page), "--images", images]) == 0
    data = json.loads((rows / "speed_bench.json").read_text())
    data["tables"][0]["rows"][3]["flatten20"] = "91.5"
    (rows / "speed_bench.json").write_text(json.dumps(data))
    assert report.main(["--check", "--rows", str(rows), "--out", str(page), "--images", images]) == 1
    assert "differs from the rows" in capsys.readouterr().err


def test_a_run_without_date_is_refused(tmp_path):
    rows = copy_rows(tmp_path)
    data = json.loads((rows / "resume.json").read_text())
    del data["runs"]["memory"]["date"]
    (rows / "resume.json").write_text(json.dumps(data))
    with pytest.raises(report.RowsError, match="resume.json: run 'memory' has no date"):
        report.load(rows)


def test_plots_are_byte_stable_and_committed(tmp_path):
    """Re-rendering in another process gives the committed bytes (no timestamp or version in the PNG)."""
    for data in report.load(report.ROWS):
        if not data.get("model") or not report.plot_points(data):
            continue
        name = report.image_name(data)
        report.write_plot(data, tmp_path / name)
        assert (tmp_path / name).read_bytes() == (report.IMAGES / name).read_bytes(), \
            f"{name} is stale: run python benchmarks/report.py"


@pytest.mark.parametrize("model, calibration, windows, sweep, protocol", [
    ("smollm2-135m", "wikipedia", {"wikitext2": 24, "c4": 16, "code": 16}, False, "held-out"),
    ("qwen2.5-0.5b", "wikipedia", {"wikitext2": 16, "c4": 8, "code": 8}, False, "held-out"),
    ("qwen2.5-0.5b", "wikipedia", {"wikitext2": 8, "code": 8}, True, "held-out, 8 windows"),
    ("smollm2-135m", "wikitext2", {"wikitext2": 24}, False, "in-domain"),
    ("gemma3-270m", "wikipedia", {"wikitext2": 24}, False, "held-out"),
])
def test_compare_methods_rows_land_in_the_committed_tables(model, calibration, windows, sweep, protocol):
    """A raw compare_methods row becomes a row of the protocol and method names the committed tables use."""
    raw = {"method": "FlattenGPT", "n": 2 if sweep else compare_methods.MODELS[model], "calibration": calibration,
           "eval_windows": windows, "layers": 16, "params_pct": 88.21, "ppl": {k: 12.3456 for k in windows},
           "compress_s": 100.4, "peak_rss_mib": 2048.0, "calibration_config": {"samples": 32, "seq_len": 512}}
    row = compare_methods.committed_row(raw, model, sweep)
    assert row["protocol"] == protocol and row["method"] == "FlattenGPT (ours)"
    assert row["params_pct"] == 88.2 and set(row["ppl"].values()) == {12.35}
    assert row["compress_s"] == 100 and row["peak_rss_gib"] == 2.0
    assert ("n" in row) == sweep
    committed = json.loads((report.ROWS / compare_methods.ROW_FILES[model][0]).read_text())
    assert protocol in {r["protocol"] for r in committed.get("rows", []) + committed.get("sweep", [])}
    assert any(r["method"] == "FlattenGPT (ours)" for r in committed.get("rows", []) + committed.get("sweep", []))
