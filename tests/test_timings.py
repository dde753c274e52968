"""The timings log (``recipe_engine.execution.timings``): a record for every layer of every pass, phases that
add up to the run's clock, a copy in the output, and the layers a SIGKILLed run finished."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

import recipe_engine
from recipe_engine.execution.timings import Timings, read_timings, summarize
from tests.helpers import BYTE_VOCAB, byte_tokenizer, save_tiny_model, start_signal_driver, tiny_model

STEPS = ["FlattenAdjacent<n:1>", "HeadPrune", "NystromMLP", "GPTQ<group_size:16>"]


def recipe(tmp_path: Path, model: Path, steps, stream: str = "on") -> dict:
    data = tmp_path / "cal.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    return {"version": 1, "name": "timed", "model": str(model), "output": str(tmp_path / "out"), "stream": stream,
            "calibration": {"dataset": str(data), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": steps}


def test_a_streamed_run_records_every_layer_of_every_pass_and_its_phases_add_up(tmp_path):
    save_tiny_model(tmp_path / "model", num_hidden_layers=4, intermediate_size=96)
    _, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", STEPS), progress=False)
    records = read_timings(tmp_path / "out" / "timings.jsonl")  # the finished output holds the log
    assert not (tmp_path / "out.timings.jsonl").exists()  # and nothing stays beside it

    similarity = [r["layer"] for r in records if r.get("pass") == "FlattenAdjacent similarity"]
    assert similarity == [0, 1, 2, 3] and all(r["step"] == "0 FlattenAdjacent" for r in records[:4])
    layer_pass = [r for r in records if r.get("pass") == "layer-sequential pass"]
    assert [r["layer"] for r in layer_pass] == [0, 1, 2]  # 4 layers, one merge
    assert {r["step"] for r in layer_pass} == {"1-3 HeadPrune, NystromMLP, GPTQ"}
    merged = report.steps[0].result["groups"][0]["layer"]
    for r in layer_pass:  # each step's share of the layer, where the step acts on it
        acting = {"GPTQ"} | ({"HeadPrune", "NystromMLP"} if r["layer"] == merged else set())
        assert set(r["by_step"]) == acting | {"shared"}, r
        assert r["by_step"]["GPTQ"]["compress"] > 0 and r["seconds"]["forward"] > 0
        totals = {phase: sum(part.get(phase, 0) for part in r["by_step"].values()) for phase in r["seconds"]}
        assert totals == pytest.approx(r["seconds"], abs=1e-3)
    events = [r for r in records if r.get("event") == "step"]
    assert [r["step"] for r in events] == ["0 FlattenAdjacent", "1-3 HeadPrune, NystromMLP, GPTQ"]
    assert records[-1]["event"] == "output written"
    # the output's record: units read back from staging or the source, packed, and the rest of the write
    assert {"read", "pack", "write"} <= set(records[-1]["seconds"]) and records[-1]["seconds"]["pack"] > 0
    # every interval of the run's clock is charged to exactly one record and phase
    charged = sum(sum(r["seconds"].values()) for r in records)
    assert charged == pytest.approx(records[-1]["at_s"], abs=0.01 + 1e-4 * len(records))
    # the wall clock keeps the run's clock's pace (records line up with an outside monitor's samples)
    assert all(b["unix_s"] - a["unix_s"] == pytest.approx(b["at_s"] - a["at_s"], abs=0.05)
               for a, b in zip(records, records[1:]))
    # host memory at each record: a run holds well over the interpreter's 10 MiB, at most its high-water mark,
    # which never goes down within a step (the report's per-step peaks reset it between steps)
    assert all(10 < r["host_rss_mib"] <= r["host_high_water_mib"] + 0.1 for r in records)
    for step in {r["step"] for r in records if r["step"]}:
        marks = [r["host_high_water_mib"] for r in records if r["step"] == step]
        assert marks == sorted(marks), step
    by_step = summarize(records)
    assert by_step["0 FlattenAdjacent"]["compress"] > 0  # the merge itself, outside the pass's forwards
    # a step's records (its layers and its end) hold its wall time
    for event in events:
        own = sum(sum(r["seconds"].values()) for r in records if r["step"] == event["step"])
        assert own == pytest.approx(event["wall_s"], rel=0.05, abs=0.02)


def test_timings_path_option_and_no_log_without_an_output(tmp_path, monkeypatch):
    save_tiny_model(tmp_path / "model", num_hidden_layers=2)
    target = tmp_path / "logs" / "run.jsonl"
    recipe_engine.apply(recipe(tmp_path, tmp_path / "model", ["GPTQ<group_size:16>"], stream="off"),
                        progress=False, timings=target)
    assert [r["layer"] for r in read_timings(target) if "layer" in r] == [0, 1]
    assert not (tmp_path / "out.timings.jsonl").exists()
    again = recipe(tmp_path, tmp_path / "model", ["GPTQ<group_size:16>"], stream="off")
    recipe_engine.apply({**again, "output": str(tmp_path / "second")}, progress=False, write=False)
    assert not (tmp_path / "second.timings.jsonl").exists() and not (tmp_path / "second").exists()
    # a run that fails after it started its log leaves nothing beside the output; a named log stays
    from recipe_engine.execution.pipeline import LayerPipeline

    def fail(*_args, **_kwargs):
        raise RuntimeError("a step failed")
    monkeypatch.setattr(LayerPipeline, "run_layer_modifiers", fail)
    failing = {**again, "output": str(tmp_path / "third"), "modifiers": ["FuseNorm", "GPTQ<group_size:16>"]}
    with pytest.raises(RuntimeError, match="a step failed"):
        recipe_engine.apply(failing, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("third")) == []
    with pytest.raises(RuntimeError, match="a step failed"):
        recipe_engine.apply(failing, progress=False, timings=tmp_path / "named.jsonl")
    assert (tmp_path / "named.jsonl").is_file()


def test_phases_nest_and_a_cut_last_line_is_skipped(tmp_path):
    log = tmp_path / "t.jsonl"
    timings = Timings(log)
    with timings.phase("compress"):
        time.sleep(0.02)
        with timings.phase("forward"):
            time.sleep(0.03)
    timings.moved(torch.zeros(4, dtype=torch.float32), torch.device("meta"))  # host -> not the host
    timings.record(layer=0)
    timings.close()
    with log.open("a") as handle:
        handle.write('{"layer": 1, "seco')  # a write cut by a kill
    (record,) = read_timings(log)
    assert record["layer"] == 0 and record["bytes_to_device"] == 16
    assert 0.03 <= record["seconds"]["forward"] < 0.03 + 0.02 and 0.02 <= record["seconds"]["compress"] < 0.05


def test_a_sigkilled_run_leaves_the_layers_it_finished(tmp_path):
    model = tmp_path / "model"
    tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=3).save_pretrained(model, safe_serialization=True)
    byte_tokenizer().save_pretrained(model)
    work = tmp_path / "kill"
    work.mkdir()
    spec = recipe(work, model, ["FuseNorm", "StallInPass"], stream="off")
    (work / "r.yaml").write_text(yaml.safe_dump(spec))
    case = {"name": "kill", "point": "pass", "stall": "python", "cwd": str(work),
            "argv": ["apply", str(work / "r.yaml"), "--quiet", "--device", "cpu"], "env": {}}
    driver, base = start_signal_driver(tmp_path, [case])
    try:
        deadline = time.monotonic() + 120
        while not (base / "kill.ready").exists():
            assert driver.poll() is None and not (base / "kill.rc").exists(), driver.communicate()
            assert time.monotonic() < deadline, "the run never reached its stall"
            time.sleep(0.05)
        os.kill(int((base / "kill.pid").read_text()), signal.SIGKILL)
        driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert (base / "kill.rc").read_text() == str(-signal.SIGKILL)
    records = read_timings(work / "out.timings.jsonl")  # stalled in layer 1: layer 0 and FuseNorm are there
    assert [(r["step"], r.get("layer"), r.get("event")) for r in records] == [
        ("0 FuseNorm", None, "step"), ("", None, "checkpoint"), ("1 StallInPass", 0, None)]
    assert json.loads((work / "out.timings.jsonl").read_text().splitlines()[-1])["pass"] == "layer-sequential pass"


def test_profile_traces_a_few_layers_and_tables_the_top_operations(tmp_path):
    save_tiny_model(tmp_path / "model", num_hidden_layers=6)
    spec = recipe(tmp_path, tmp_path / "model", ["GPTQ<group_size:16>"], stream="off")
    recipe_engine.apply(spec, progress=False, profile=tmp_path / "profile")
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}  # skip 1, warm up 1, trace 3 layers
    table = (tmp_path / "profile" / "top_operations.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    with pytest.raises(recipe_engine.RecipeError, match="--profile needs the timings log"):
        recipe_engine.apply(spec, progress=False, write=False, profile=tmp_path / "again")
    assert not (tmp_path / "again").exists()
