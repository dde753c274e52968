"""The GPU acceptance command runs on CPU with tiny random models (``--device cpu --tiny``), so it cannot rot
between the sessions that have a GPU; and a one-rank launch goes through a real process group."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks import scale
from benchmarks.acceptance import carry, driver, runs, smollm2, stream8b
from recipe_engine.execution.distributed import launched
from recipe_engine.execution.stats import InputCovariance
from tests.helpers import byte_tokenizer, free_port, shared_data

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE = [sys.executable, "-m", "benchmarks.acceptance"]


def script_environment(env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ACCEPTANCE, *args], capture_output=True, text=True, cwd=ROOT,
                          env=script_environment(env), timeout=900)


def run_scripts_side_by_side(*argvs: list[str], logs: Path) -> list[tuple[int, str]]:
    """Several one-thread acceptance commands at once (the suite's machine has two cores); each one's exit code
    and its stdout and stderr (kept in ``logs``, so that neither waits on a full pipe)."""
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    for i, argv in enumerate(argvs):
        with open(logs / f"{i}.log", "w") as log:
            processes.append(subprocess.Popen([*ACCEPTANCE, *argv], cwd=ROOT, env=script_environment(), stdout=log,
                                              stderr=subprocess.STDOUT))
    return [(process.wait(timeout=900), (logs / f"{i}.log").read_text()) for i, process in enumerate(processes)]


def test_tiny_acceptance_on_cpu_writes_every_leg_with_its_goal(tmp_path):
    """Every leg but the serving ones, which the detached test below runs the way a lent GPU's call does; in two
    commands side by side, each with half the legs (their figures and rows then read as one result)."""
    halves = {tmp_path / "a": ("graphs", "smollm2", "dp"), tmp_path / "b": ("offload", "stream8b", "moe")}
    runs = run_scripts_side_by_side(*[["--device", "cpu", "--tiny", "--out", str(out), "--legs", *legs]
                                      for out, legs in halves.items()], logs=tmp_path / "logs")
    for code, output in runs:
        assert code == 0, output[-4000:]
    results = [json.loads((out / "gpu_acceptance.json").read_text()) for out in halves]
    for out, result in zip(halves, results):
        assert result["complete"] and result["tiny"]
        assert {leg: r["status"] for leg, r in result["legs"].items()} == dict.fromkeys(halves[out], "ok"), \
            result["legs"]
        kept = [p for p in (out / "work").rglob("*") if p.is_file()]  # logs and recipes only
        assert kept and {p.suffix for p in kept} <= {".log", ".yaml", ".json"}
        assert result["machine"]["disk_write_mb_s"][str(out)] > 0
    result = {**results[1], "legs": {**results[0]["legs"], **results[1]["legs"]},
              "rows": results[0]["rows"] + results[1]["rows"]}
    stdout = "\n".join(output for _, output in runs)
    assert result["legs"]["offload"]["figures"]["identical_weights"]
    graphs = result["legs"]["graphs"]["figures"]
    assert graphs["act_order"]["identical"] and graphs["dynamic_groups"]["identical"]
    machine = result["machine"]
    assert machine["device"] == "cpu" and machine["torch"] == torch.__version__ and machine["date"]
    assert "--tiny" in machine["command"]
    rows = {(r["leg"], r["figure"]): r for r in result["rows"]}
    assert all(r["goal"] for r in rows.values())
    # the SmolLM2 leg compares a device run with a CPU run: on CPU both are the same run
    smollm2 = [r for r in result["rows"] if r["leg"] == "smollm2"]
    assert len(smollm2) == 4 and all(r["met"] for r in smollm2)
    figures = result["legs"]["smollm2"]["figures"]["figures"]
    assert figures["flatten"]["merges"] and figures["flatten"]["layers"] == 6  # n = 2 on 8 layers
    assert figures["gptq"]["ppl_after"] > 1
    stream = result["legs"]["stream8b"]["figures"]
    assert stream["layers"] == "8 -> 6" and stream["peak_gpu_mib"] is None  # no GPU: no GPU peak
    assert set(stream["steps_own_s"]) == {"0 FlattenAdjacent", "1 HeadPrune", "2 NystromMLP", "3 GPTQ"}
    assert stream["peak_host_gib"] > 0 and stream["gpu_estimate_mib"] > 0
    # the run's timings log: kept in OUT, every layer of every pass, seconds by phase per step
    timings = stream["timings"]
    assert Path(timings["log"]).parent == tmp_path / "b" and set(timings["seconds_by_step"]) >= {
        "0 FlattenAdjacent", "1-3 HeadPrune, NystromMLP, GPTQ"}
    assert timings["layers_done"] == {"0 FlattenAdjacent: FlattenAdjacent similarity": 8,
                                      "1-3 HeadPrune, NystromMLP, GPTQ: layer-sequential pass": 6}
    assert all(r["met"] is None for r in result["rows"] if r["leg"] == "stream8b")  # time goals: on a GPU only
    dp = result["legs"]["dp"]["figures"]
    assert dp["backend"] == "gloo" and dp["ranks"] == 1 and dp["identical_weights"] is True
    moe = result["legs"]["moe"]["figures"]  # every expert of every layer quantized, none left in bf16
    assert moe["expert_methods"] == {"gptq": moe["expert_rows"]} and moe["expert_rows"] == 2 * 8 * 2
    assert moe["per_layer_s"] > 0 and moe["peak_gpu_mib"] is None and moe["gpu_estimate_mib"] > 0
    assert "dp" in stdout and "met" in stdout  # the table


def fake_carry(directory: Path) -> Path:
    """What ``--prepare-carry`` puts in ``b`` (no wheels: this machine has every package), with a byte-level
    tokenizer that tells itself apart from SmolLM2's."""
    b = directory / "b"
    (b / "wheels").mkdir(parents=True)
    byte_tokenizer().save_pretrained(b / "tokenizer")
    shutil.copytree(shared_data() / "wikitext-2-raw",
                    b / "data" / "wikitext-2-raw")
    (b / "wiki.utf8").write_text("A carried sample of text. " * 4000)
    (b / "manifest.json").write_text(json.dumps({"gguf_sha256": "", "gguf_bytes": 0, "wheels": []}))
    return directory


def test_the_serving_call_carries_b_alone_and_builds_what_it_times(tmp_path):
    """The docstring's serving call, rehearsed on CPU: it carries only ``b`` and runs detached; the child is handed
    the carried tokenizer (``--tokenizer``); bench and w4 build the checkpoints they time (no other leg's output)
    and run first, whatever order --legs names them."""
    carried, work = fake_carry(tmp_path / "carry"), tmp_path / "work"
    run = run_script("--carry", str(carried), "--device", "cpu", "--tiny", "--out", str(tmp_path / "b"), "--work",
                     str(work), "--pack", "--legs", "w4", "bench", "--budget", "20", "--detach", "--follow", "600",
                     env={"RECIPE_CARRY_SITE": str(tmp_path / "site")})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "b" / "gpu_acceptance.json").read_text())
    legs = result["legs"]
    assert list(legs) == ["bench", "w4"] and legs["bench"]["status"] == legs["w4"]["status"] == "ok", legs
    assert sorted(p.name for p in (work / "serving").iterdir()) == ["cut-6-bf16", "cut-6-w4g32", "dense-8-bf16"]
    written = AutoTokenizer.from_pretrained(work / "serving" / "dense-8-bf16")
    assert len(written) == len(byte_tokenizer())  # the carried tokenizer, not SmolLM2's 49,152 tokens
    bench = legs["bench"]["figures"]
    assert bench["layers"] == [8, 6] and bench["limit"] > 1 and bench["compiled"] is False  # the head dominates
    assert len(bench["throughput"]["ratio"]) == 2 and bench["invocations_apart"] >= 0  # two invocations
    assert bench["decode_step"] == "eager" and all(len(w["throughput"]) == 1 for w in bench["warmup_s"])  # on CPU
    warmup = next(r for r in result["rows"] if r["figure"].startswith("decode step warm-up (eager)"))
    assert warmup["value"] == round(max(s for w in bench["warmup_s"] for q in w.values() for s in q), 1)
    w4 = legs["w4"]["figures"]
    assert w4["weights"] == ["bfloat16", "int4 (packed)"] and w4["bytes_ratio"] < 1 and w4["limit"] > 1
    assert all(r["met"] is None for r in result["rows"])  # time goals are judged on a GPU only
    # --pack: OUT holds the result, the detached run's log and one archive with every run's log and recipe
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.is_file()) == [
        "acceptance.log", "gpu_acceptance.json", "runs.tar.gz"]
    with tarfile.open(tmp_path / "b" / "runs.tar.gz") as archive:
        names = archive.getnames()
    assert "logs/bench/bench-1.log" in names and "logs/w4/w4.log" in names


def test_the_detached_child_is_handed_the_carried_tokenizer():
    argv = ["--carry", ".gpu", "--device", "cuda", "--detach", "--follow", "570", "--legs", "bench", "w4",
            "--tokenizer=smollm2-135m"]
    assert carry.child_arguments(argv, "/tmp/c/b/tokenizer") == [
        "--device", "cuda", "--legs", "bench", "w4", "--tokenizer", "/tmp/c/b/tokenizer"]
    assert carry.child_arguments(["--carry=.gpu", "--detach", "--tokenizer", "t"], None) == ["--tokenizer", "t"]


def test_a_failing_leg_is_recorded_and_the_next_leg_runs(tmp_path, monkeypatch):
    ran = []

    def broken(*_args):
        ran.append("smollm2")
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    def fine(name):
        def leg(*_args):
            ran.append(name)
            return {"x": 1}, [driver.row(name, "a figure", 1.0, "s", "<= 2", True)]
        return leg

    monkeypatch.setattr(driver, "leg_smollm2", broken)
    for name in ("graphs", "stream8b", "bench", "dp", "offload", "w4", "moe"):
        monkeypatch.setattr(driver, f"leg_{name}", fine(name))
    monkeypatch.setattr(driver, "disk_write_speed", lambda _directory: 1.0)
    assert driver.main(["--device", "cpu", "--out", str(tmp_path), "--work", str(tmp_path / "w")]) == 0
    assert ran == ["bench", "w4", "graphs", "smollm2", "dp", "offload", "stream8b", "moe"]  # the serving goals first
    result = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert result["complete"]
    assert result["legs"]["smollm2"]["status"] == "error"
    assert result["legs"]["smollm2"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert [r["met"] for r in result["rows"]] == [True, True, True, False, True, True, True, True]
    assert result["rows"][3]["error"] == result["legs"]["smollm2"]["error"]


def test_missing_package_is_one_line_before_any_work(tmp_path):
    # as on the GPU image before the wheels are carried: pydantic and gguf are not found
    code = ("import sys, importlib.util; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n in ('pydantic', 'gguf') else real(n, *a)\n"
            f"sys.argv = ['acceptance', '--device', 'cpu', '--tiny', '--out', {str(tmp_path / 'out')!r}]\n"
            "from benchmarks.acceptance import driver\n"
            "sys.exit(driver.main())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: missing Python packages: pydantic, gguf;")
    assert "--prepare-carry" in lines[0] and "pydantic-core" in lines[0]
    assert not (tmp_path / "out").exists()


def test_one_rank_launch_runs_its_collectives_through_a_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    stat = InputCovariance("")
    stat.update(x, None)
    expected = x.reshape(-1, 3).T @ x.reshape(-1, 3)
    with launched(torch.device("cpu")) as parallel:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert parallel.active and parallel.world == 1 and parallel.share(4) == range(0, 4)
        parallel.reduce_statistics([stat])
        outputs = parallel.gather([torch.ones(2, 3), torch.zeros(1, 3)], 2)
    assert not dist.is_initialized()
    torch.testing.assert_close(stat.gram, expected, rtol=0, atol=0)
    assert stat.count == 10
    assert [o.tolist() for o in outputs] == [[[1.0] * 3] * 2, [[0.0] * 3]]


def test_without_a_launcher_no_process_group(monkeypatch):
    import torch.distributed as dist

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with launched(torch.device("cpu")) as parallel:
        assert not parallel.active and not dist.is_initialized()


def test_full_size_recipes_are_valid_for_their_models(tmp_path):
    """What a GPU runs without --tiny: the SmolLM2 leg's two recipes and the 8B-shaped recipe validate
    against their configs (group sizes divide, merges fit), before any GPU time is spent on them."""
    from argparse import Namespace

    from transformers import LlamaConfig

    from recipe_engine.sources.models import load_config
    from recipe_engine.recipe.schema import recipe_from_dict
    from recipe_engine.plan.preflight import check_against_config

    for recipe in smollm2.smollm2_recipes("cuda", tmp_path, tiny=False).values():
        assert recipe["model"] == "smollm2-135m" and recipe["device"] == "cuda"
        check_against_config(recipe_from_dict(recipe), load_config("smollm2-135m"))
    args = Namespace(device="cuda", tiny=False, samples=128, seq_len=2048)
    recipe = stream8b.stream8b_recipe(args, tmp_path / "llama3-8b-bf16", tmp_path)
    config = LlamaConfig(num_hidden_layers=stream8b.LLAMA3_8B_LAYERS, **scale.LLAMA3_8B)
    shape = check_against_config(recipe_from_dict(recipe), config)
    assert shape.num_layers == 25 and recipe["dtype"] == "bfloat16" and recipe["stream"] == "on"


def test_smollm2_leg_judges_against_the_committed_cpu_reference(tmp_path, monkeypatch):
    reference = json.loads(smollm2.REFERENCE.read_text())["figures"]
    assert reference["flatten"]["merges"] == [[3, 4], [9, 10], [12, 13], [14, 15], [17, 18], [26, 27]]

    def leg(figures):
        monkeypatch.setattr(smollm2, "smollm2_figures", lambda *_a: figures)
        args = type("Args", (), {"device": "cuda", "tiny": False})
        return {r["figure"]: r["met"] for r in smollm2.leg_smollm2(args, tmp_path)[1]}

    close = json.loads(json.dumps(reference))
    close["flatten"]["ppl_after"] *= 1.009
    close["gptq"]["ppl_after"] *= 0.992
    assert all(leg(close).values())
    off = json.loads(json.dumps(reference))
    off["gptq"]["ppl_after"] *= 1.011
    off["flatten"]["merges"][0] = [2, 3]
    met = leg(off)
    assert met["GPTQ W4 g64 WikiText-2 PPL"] is False and met["FlattenGPT merged layers"] is False
    assert met["FlattenGPT WikiText-2 PPL"] is True


def test_gpu_gaps_charges_each_idle_gap_to_its_phase_and_host_operation():
    """``benchmarks/diagnosis/gpu_gaps.py`` on a hand-built trace: kernels (two overlapping) busy 0-10, 12-20 (a
    copy), 20-30 and 80-100 µs; phases ``compress`` 0-50 and ``write`` 50-100 on the engine's thread, a host read at
    30-80 and an operation on another thread that must not be charged. Busy 48 of 100 µs; the gaps 10-12 (2 µs, too
    short to name an operation) and 30-80 (50 µs, in ``compress``, charged to the read)."""
    from benchmarks.diagnosis.gpu_gaps import format_summary, gap_summary

    def span(cat, name, start, end, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "tid": tid}

    trace = {"traceEvents": [
        span("kernel", "k1", 0, 6), span("kernel", "k2", 4, 10), span("gpu_memcpy", "copy", 12, 20),
        span("kernel", "k3", 20, 30), span("kernel", "k4", 80, 100),
        span("user_annotation", "phase:compress", 0, 50), span("user_annotation", "phase:write", 50, 100),
        span("cpu_op", "aten::_local_scalar_dense", 30, 80), span("cpu_op", "aten::copy_", 5, 95, tid=2)]}
    summary = gap_summary(trace)
    assert round(summary["busy_s"] * 1e6, 6) == 48 and round(summary["window_s"] * 1e6, 6) == 100
    assert summary["busy_share"] == 0.48
    assert {k: round(v * 1e6, 6) for k, v in summary["idle_by_phase_s"].items()} == {"compress": 52}
    assert {k: round(v * 1e6, 6) for k, v in summary["idle_by_operation_s"].items()} == \
        {"aten::_local_scalar_dense": 50}
    assert summary["longest_gaps"][0]["ms"] * 1e3 == 50 and summary["longest_gaps"][0]["phase"] == "compress"
    assert "48.0%" in format_summary(summary)
    assert gap_summary({"traceEvents": [span("cpu_op", "aten::mm", 0, 5)]}) == {"device_events": 0}


def test_runs_use_the_engine_named_by_engine(tmp_path, monkeypatch):
    """``--engine DIR``: a run's ``python -m recipe_engine.cli`` is DIR's package, not this checkout's (here a
    package that only prints where it is), and the default is this checkout's."""
    fake = tmp_path / "engine" / "recipe_engine" / "cli"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("import recipe_engine; print('engine at', recipe_engine.__file__)\n")
    command = [sys.executable, "-m", "recipe_engine.cli"]
    monkeypatch.setattr(runs, "ENGINE", tmp_path / "engine")
    runs.run_logged(command, tmp_path / "other.log", 60)
    assert (tmp_path / "other.log").read_text().strip() == f"engine at {fake.parent / '__init__.py'}"
    monkeypatch.setattr(runs, "ENGINE", ROOT)
    runs.run_logged([*command, "--version"], tmp_path / "this.log", 60)
    assert "engine at" not in (tmp_path / "this.log").read_text()


def test_host_samples_charge_wall_time_to_threads_and_to_the_frames_under_a_phase(tmp_path):
    """``benchmarks/diagnosis/host_samples.py`` on py-spy's raw lines: seconds = samples / rate per thread (the first
    frame), and under a frame only the samples through it, each frame below counted once per sample (inclusive),
    checked against the counts written here."""
    from benchmarks.diagnosis.host_samples import breakdown, read_samples, summarize

    raw = tmp_path / "samples.txt"
    raw.write_text("thread (1): MainThread;cmd_apply (c.py:1);write_checkpoint (w.py:2);pack (p.py:3) 30\n"
                   "thread (1): MainThread;cmd_apply (c.py:1);write_checkpoint (w.py:2);write (w.py:9) 20\n"
                   "thread (1): MainThread;cmd_apply (c.py:1);run_layer (r.py:5) 40\n"
                   "thread (2): recipe-output-writer;_write (w.py:40);pack (p.py:3) 10\n"
                   "malformed line without a count\n")
    samples = read_samples(raw)
    assert len(samples) == 4
    text = summarize(samples, 10, "write_checkpoint", 5)
    assert "    9.00  thread (1): MainThread" in text and "    1.00  thread (2): recipe-output-writer" in text
    assert "under 'write_checkpoint': 5.00 s" in text
    assert "    3.00  pack (p.py:3)" in text and "    2.00  write (w.py:9)" in text  # not the other thread's pack
    both = breakdown(samples, 10, ["cmd_apply", "run_layer"], 5)
    assert both.count("seconds by thread") == 1 and "under 'cmd_apply': 9.00 s" in both \
        and "under 'run_layer': 4.00 s" in both


def test_host_work_counts_each_launch_once_and_a_block_program_as_one_replay():
    """``benchmarks/diagnosis/gptq_host_work.py``'s ``Launches``: an operation that runs a kernel counts once (a
    product, a copy, a reduction), a view, an allocation and a host read count nothing, and a block program's run counts
    once as a graph replay, whatever it holds."""
    from benchmarks.diagnosis.gptq_host_work import Launches

    a = torch.arange(16.0).reshape(4, 4)
    launches = Launches()
    program = launches.program(lambda: (a + 1) * 2 - a.exp())
    with launches:
        b = a @ a
        views = b.t(), b[1:], b.diagonal(), b.view(16)
        copy = b.clone()
        total = float(b.sum())
        torch.empty(3)
        program()
        program()
    assert dict(launches.counts) == {"mm": 1, "clone": 1, "sum": 1, "graph replay": 2}
    assert total == float((a @ a).sum()) and len(views) == 4 and torch.equal(copy, b)


def test_the_whole_run_is_extrapolated_by_what_grows_with_the_layers(tmp_path):
    """``benchmarks.acceptance.moe.pass_figures`` on a made-up run: 3 layers (the first slow, warming up; then 2 s
    each), a trace 20 % busy in the first layer and 90 % after, a 40 s run 50 % busy, a 4 s write of which the
    layers are 75 %. Extrapolated to 9 layers: the 6 added layers at 2 s and 90 %, the write's layer part
    twice more; by hand, not by the code's formula. The written layer share comes from the safetensors headers."""
    from datetime import datetime

    from safetensors.torch import save_file

    from benchmarks.acceptance.moe import layer_bytes_share, pass_figures

    t0 = 1_800_000_000.0
    ends = [t0 + 5, t0 + 7, t0 + 9]  # layer 0: t0 .. t0+5 (warm-up); layers 1, 2: 2 s each
    records = [{"step": "0 GPTQ", "pass": "layer-sequential pass", "layer": i, "layers": 3,
                "seconds": {"compress": end - (ends[i - 1] if i else t0)}, "unix_s": end} for i, end in enumerate(ends)]
    (tmp_path / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = []
    for k in range(0, 91):  # a sample every 0.1 s from t0 to t0 + 9
        stamp = t0 + k / 10
        busy = 20 if stamp < t0 + 5 else 90
        lines.append(f"{datetime.fromtimestamp(stamp).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {busy}, 0, 0")
    (tmp_path / "trace.csv").write_text("\n".join(lines) + "\n")
    result = {"wall_s": 40.0, "gpu_busy": 0.5, "trace_path": tmp_path / "trace.csv",
              "timings_path": tmp_path / "timings.jsonl"}
    figures = pass_figures(result, 9, write_s=4.0, write_share=0.75)
    pass_busy = (50 * 0.2 + 41 * 0.9) / 91  # the samples from t0 to t0 + 9
    assert figures["pass_gpu_busy"] == round(pass_busy, 3)
    assert figures["steady_layer_s"] == 2.0 and figures["steady_gpu_busy"] == 0.9
    whole = 40.0 + 6 * 2.0 + 4.0 * 0.75 * 6 / 3
    assert figures["whole_run_s"] == round(whole, 2)
    assert figures["whole_run_gpu_busy"] == round((0.5 * 40.0 + 0.9 * 12.0) / whole, 3)
    assert pass_figures(result, 3, 4.0, 0.75)["whole_run_s"] == 40.0  # nothing added: the run itself

    save_file({"model.embed_tokens.weight": torch.zeros(100, dtype=torch.bfloat16),
               "model.layers.0.mlp.weight": torch.zeros(300, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    assert layer_bytes_share(tmp_path) == 0.75


def test_the_packed_serving_checkpoint_holds_each_linears_round_to_nearest_w4_codes(tmp_path):
    """``serving.packed_copy``: every decoder linear of the bf16 source, read back through the bench's int4 loader,
    is the symmetric 4-bit round to nearest of groups of 32 computed here by hand (scale ``2·max|w| / 15`` stored
    in bf16, codes ``clamp(round(w / s) + 8, 0, 15)``); everything else is the source's, bit for bit."""
    from safetensors.torch import load_file

    from benchmarks.acceptance.serving import packed_copy
    from recipe_engine.evaluation.bench.int4 import check_packed, dequantize, packed_config, pop_packed

    source = scale.write_synthetic(tmp_path / "cut", 2, torch.bfloat16, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=49152)
    packed = packed_copy(source, tmp_path / "packed", 32)
    config = packed_config(str(packed))
    check_packed("packed", config, torch.device("cpu"), "bfloat16", str(packed))
    assert config["ignore"] == ["lm_head"]
    before = {k: v for f in source.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    after = {k: v for f in packed.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    linears = [k.removesuffix(".weight") for k in before if k.startswith("model.layers.") and "_proj" in k]
    assert len(linears) == 2 * 7
    for name in linears:
        weight = before.pop(f"{name}.weight").float()
        rows, columns = weight.shape
        groups = weight.view(rows, columns // 32, 32)
        step = (2 * groups.abs().amax(-1, keepdim=True) / 15).to(torch.bfloat16).float()
        codes = torch.clamp(torch.round(groups / step) + 8, 0, 15)
        expected = (step * (codes - 8)).view(rows, columns).to(torch.bfloat16)
        values, scales, zero = pop_packed(after, name)
        assert zero is None and scales.dtype == torch.bfloat16
        assert torch.equal(dequantize(values, scales, zero).to(torch.bfloat16), expected), name
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_serving_legs_capture_the_decode_step_on_a_gpu_and_run_eager_elsewhere():
    from argparse import Namespace

    from benchmarks.acceptance.bench import bench_command

    def step(device, choice="graphs"):
        argv = bench_command(Namespace(tiny=False, bench_repeats=30, device=device, bench_compile=choice), "a", "b",
                             Path("o.json"), ("latency",))
        return argv[argv.index("--compile") + 1]
    assert (step("cuda"), step("cuda:1", "on"), step("cpu")) == ("graphs", "on", "off")


def test_the_recorded_runs_split_sums_to_their_wall_and_the_stored_table_is_the_scripts():
    """``benchmarks.diagnosis.apply_split``: each recorded run's parts (every step's logged phases, the output's
    write, the rest) add up to its ``apply_wall_s`` (the rest is the difference, so no part may be negative or
    counted twice), and the table BENCHMARKS renders is what the script makes of the raw runs now."""
    from benchmarks.diagnosis import apply_split

    for spec in (apply_split.BEFORE, apply_split.AFTER):
        figures = apply_split.recorded_run(spec)[0]
        parts = apply_split.split(figures)
        whole = parts.pop("the whole `recipe apply`")
        logged = sum(sum(s.values()) for s in figures["timings"]["seconds_by_step"].values())
        assert whole == figures["apply_wall_s"] and abs(sum(parts.values()) - whole) < 1e-9
        assert all(value >= 0 for value in parts.values()), parts
        assert abs(parts["the rest (imports, loading, calibration text)"] - (whole - logged)) < 1e-9
    stored = json.loads((apply_split.RESULTS / apply_split.AFTER.partition(":")[0]).read_text())
    (table,) = [t for t in stored["tables"] if t["title"] == apply_split.TITLE]
    made = apply_split.table(apply_split.BEFORE, apply_split.AFTER)
    assert {key: table[key] for key in made} == made
    assert stored["runs"]["full"] == apply_split.recorded_run(apply_split.BEFORE)[3]
