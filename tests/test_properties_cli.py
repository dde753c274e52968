"""Property test of the CLI: mutated recipes and arguments never give a traceback.

Each example mutates a valid recipe (a value's type, an unknown or misspelled key, a duplicated key, a
YAML tag, the text encoding, truncation) or the command line (``--set`` paths and values, ``--output``,
``--device``, numeric options) and calls the CLI's ``main`` in-process on a tiny saved model. Whatever the
mutation, ``main`` returns 0 or 2 (never raises); on 2 the error is exactly one ``error: ...`` line and the
working directory is unchanged. Mutations that can never make a valid recipe must give 2.
"""
import contextlib
import io
import string
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recipe_engine.cli import main

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def base_recipe(work: Path, model_dir: Path) -> dict:
    return {"version": 1, "name": "t", "model": str(model_dir), "output": str(work / "out"),
            "calibration": {"dataset": str(work / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2,
                            "seed": 0},
            "modifiers": ["FuseNorm", {"FuseNorm": {"untie": False}}]}


def run(argv: list[str], work: Path) -> tuple[int, str]:
    """Call main; any exception escaping it fails the property (that is the traceback a user would see)."""
    before = sorted(p.name for p in work.iterdir())
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert code in (0, 2), (argv, code, lines)
    assert not any("Traceback" in line for line in lines), lines
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert sorted(p.name for p in work.iterdir()) == before, (argv, lines)
    return code, "\n".join(lines)


@contextlib.contextmanager
def workdir():
    """A fresh directory with cal.txt, also the working directory (a mutated relative output lands here)."""
    with tempfile.TemporaryDirectory() as name:
        work = Path(name)
        (work / "cal.txt").write_text(TEXT)
        with contextlib.chdir(work):
            yield work


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=True),
                    st.sampled_from([10**23, 2**63, -2**63 - 1, 2**64]),  # integers torch cannot take
                    st.text(max_size=12), st.lists(st.integers(), max_size=3),
                    st.dictionaries(st.text(string.ascii_letters, max_size=5), st.integers(), max_size=2))
KEYS = st.text(string.ascii_letters + "_", min_size=1, max_size=12)
PATHS = [(), ("calibration",), ("modifiers", 1, "FuseNorm")]
TAGS = ["!!python/object/apply:os.system ['true']", "!!python/name:os.system", "!!binary aGVsbG8=",
        "!custom 3", "!!timestamp 2001-12-14", "!!set {a, b}", "&a [*a]", "*undefined"]


def node(data: dict, path: tuple):
    for key in path:
        data = data[key]
    return data


mutation = st.one_of(
    st.tuples(st.just("retype"), st.sampled_from(PATHS), st.integers(0, 10), SCALARS),
    st.tuples(st.just("unknown key"), st.sampled_from(PATHS), KEYS, SCALARS),
    st.tuples(st.just("misspell"), st.sampled_from(PATHS), st.integers(0, 10), st.integers(0, 50)),
    st.tuples(st.just("duplicate"), st.sampled_from(["version", "modifiers", "calibration", "samples"])),
    st.tuples(st.just("tag"), st.sampled_from(["name", "samples", "model", "dtype"]), st.sampled_from(TAGS)),
    st.tuples(st.just("encoding"), st.sampled_from(["latin-1", "utf-16", "cp1252", "utf-32"])),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
)
ALWAYS_INVALID = {"unknown key", "duplicate", "encoding"}


def mutate(data: dict, kind: str, *args) -> bytes:
    """The recipe file's bytes after one mutation."""
    if kind in ("retype", "unknown key", "misspell"):
        target = node(data, args[0])
        keys = list(target)
        if kind == "retype":
            target[keys[args[1] % len(keys)]] = args[2]
        elif kind == "unknown key":
            if args[1] not in target:
                target[args[1] + "_x"] = args[2]
        else:
            key = keys[args[1] % len(keys)]
            cut = args[2] % len(key)
            target[key[:cut] + key[cut + 1:] + "q"] = target.pop(key)
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if kind == "duplicate":
        line = next(row for row in text.splitlines() if row.strip().startswith(f"{args[0]}:"))
        indent = line[: len(line) - len(line.lstrip())]
        return (text + f"{indent}{args[0]}: 1\n" if not indent else
                text.replace(line + "\n", line + "\n" + f"{indent}{args[0]}: 7\n", 1)).encode()
    if kind == "tag":
        lines = [f"{row.split(':')[0]}: {args[1]}" if row.strip().startswith(f"{args[0]}:") else row
                 for row in text.splitlines()]
        return "\n".join(lines).encode()
    if kind == "encoding":
        return ("# café naïve\n" + text).encode(args[0])
    raw = text.encode()
    return raw[: int(len(raw) * args[0])]


@SETTINGS
@given(mutation=mutation, command=st.sampled_from(["validate", "show", "plan", "apply"]))
def test_mutated_recipes_fail_in_one_line(model_dir, mutation, command):
    with workdir() as work:
        data = base_recipe(work, model_dir)
        (work / "r.yaml").write_bytes(mutate(data, *mutation))
        code, err = run([command, str(work / "r.yaml"), "--quiet"] if command == "apply"
                        else [command, str(work / "r.yaml")], work)
        if mutation[0] in ALWAYS_INVALID:
            assert code == 2, (mutation, err)
        if code == 0 and command == "apply":  # the output (wherever a mutation put it) is complete and marked
            written = [p.parent for p in work.rglob(".recipe_engine.json")]
            assert len(written) == 1 and (written[0] / "model.safetensors").is_file(), written


ARGUMENT = st.one_of(
    st.tuples(st.just("--set"), st.builds(lambda p, v: f"{p}={v}",
                                          st.sampled_from(["calibration.samples", "calibration.sample", "name",
                                                           "modifiers.0.untie", "modifiers.9.x", "modifiers.x",
                                                           "evaluate.perplexity.limit", "dtype", "", "a.b.c"]),
                                          st.text(string.printable, max_size=10)
                                          | st.sampled_from(["[1", "{a: 1, a: 2}", "!!python/name:os.system",
                                                             "-1", "0", "null", "'x"]))),
    st.tuples(st.just("--set"), st.text(string.printable, max_size=15)),
    st.tuples(st.just("--output"), st.sampled_from(["", " ", "/proc/x", "/dev/null", "cal.txt/sub", "cal.txt"])),
    st.tuples(st.just("--device"), st.text(max_size=8) | st.sampled_from(["cuda:7", "tpu", "cpu:x", ""])),
    st.tuples(st.just("--model"), st.sampled_from(["", "./none", "x.gguf", "cal.txt", "a/b/c", "/"])),
)


@SETTINGS
@given(arguments=st.lists(ARGUMENT, min_size=1, max_size=3), command=st.sampled_from(["validate", "apply", "show"]))
def test_mutated_arguments_fail_in_one_line(model_dir, arguments, command):
    with workdir() as work:
        (work / "r.yaml").write_text(yaml.safe_dump(base_recipe(work, model_dir), sort_keys=False))
        argv = [command, str(work / "r.yaml")]
        for flag, value in arguments:
            value = str(work / value) if flag in ("--output",) and value.startswith("cal.txt") else value
            argv += [flag, value]
        run(argv + (["--quiet"] if command == "apply" else []), work)


OPTION = st.sampled_from([["--limit", "-1"], ["--limit", "0"], ["--limit", "x"], ["--seq-len", "1e3"],
                          ["--task-limit", "-5"], ["--repeats", "0"], ["--batch", "two"], ["--warmup", "-1"],
                          ["--dtype", "int4"], ["--json", "cal.txt/x.json"], ["--json", "."],
                          ["--baseline", "cal.txt"], ["--baseline", "missing.json"], ["--device", "cuda:9"],
                          ["--task-data", "web"], ["--bogus"], ["--limit"]])


@SETTINGS
@given(command=st.sampled_from(["eval", "bench"]), model=st.sampled_from(["./none", "cal.txt", "x.gguf", "a/b/c"]),
       options=st.lists(OPTION, min_size=1, max_size=3))
def test_mutated_eval_and_bench_arguments_fail_in_one_line(command, model, options):
    with workdir() as work:
        argv = [command, model] + [part for option in options for part in option]
        code, _ = run(argv, work)
        assert code == 2
