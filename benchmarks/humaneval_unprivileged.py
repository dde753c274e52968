"""``recipe eval`` run as an unprivileged user (``nobody``), so its sandbox runs in the ``user-namespaces`` mode.

    python -m benchmarks.humaneval_unprivileged WORKDIR -- eval qwen2.5-0.5b --no-ppl --tasks humaneval \\
        --allow-code-execution --generation-batch 16 --device cpu --json WORKDIR/dense_nobody.json

Needs root (to become ``nobody``), ``unshare`` and ``setpriv``. The command runs in a private mount namespace
where each private ancestor of the interpreter's prefix and of this checkout (e.g. ``/root``) is an empty tmpfs
with only those bound back, as ``nobody`` with HOME and ``$RECIPE_CACHE`` in WORKDIR (world-writable; the model is
converted there again, as a new user's would be) and ``$RECIPE_DATA_DIR`` passed on. Compare its record with a
root run of the same command: the verdicts should be equal problem by problem (``--compare ROOT.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_sandbox import unprivileged_command

ROOT = Path(__file__).resolve().parents[1]


def verdicts(path: Path) -> dict[str, bool]:
    record = json.loads(path.read_text())
    return {task: row["passed"] for task, row in record["generation"]["tasks"]["humaneval"]["problems"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path, help="HOME and $RECIPE_CACHE of the run (made world-writable)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("ROOT_JSON", "NOBODY_JSON"),
                        help="after the run, compare two records' verdicts problem by problem")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.recipe_args = argv[split + 1:]  # the `recipe` command's arguments, after --
    code = 0
    if args.recipe_args:
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.workdir.chmod(0o777)
        workdir = str(args.workdir.resolve())
        passed_on = [f"{name}={os.environ[name]}" for name in ("OMP_NUM_THREADS", "RECIPE_DATA_DIR")
                     if name in os.environ]
        command = unprivileged_command("env", f"HOME={workdir}", f"RECIPE_CACHE={workdir}/cache", *passed_on,
                                       str(ROOT / ".venv" / "bin" / "recipe"),
                                       *args.recipe_args,
                                       reachable=(os.path.realpath(sys.base_prefix), str(ROOT)))
        code = subprocess.run(command, cwd=workdir).returncode
    if args.compare:
        root, nobody = (verdicts(p) for p in args.compare)
        differ = sorted(t for t in root if root[t] != nobody.get(t))
        print(f"root: {sum(root.values())} / {len(root)} passed; nobody: {sum(nobody.values())} / {len(nobody)}; "
              f"verdicts differ on {len(differ)}: {', '.join(differ) or 'none'}")
        code = code or (1 if differ or root.keys() != nobody.keys() else 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
