"""`recipe plan`'s host memory estimate against the peak a run measures, on real models.

Each case is one `recipe apply` in its own process (the peak is that process's own `VmHWM`); the table reads
both figures from the run's report.json (`peak_memory.rss_mib`, `peak_memory.estimate_rss_mib`, the estimate
`apply` makes in its own process), per step too.

    python -m benchmarks.plan_memory [--cases sleb_qwen smollm2_streamed smollm2_memory flatten_memory] [--work DIR]

Cases:
  sleb_qwen         SLEB<n:1> on Qwen2.5-0.5B (fp32, in memory), 4 × 512 WikiText-2 tokens, batch 4: its 24
                    probes each compute a calibration NLL over a 151,936-word vocabulary
  smollm2_streamed  ShortGPT<n:6> on SmolLM2-135M streamed in bf16, 8 × 512 tokens, perplexity on 2 windows
                    of 1024 (evaluated streamed, layer by layer)
  smollm2_memory    the same in memory
  flatten_memory    FlattenGPT (recipes/flatten20_smollm2.yaml: FuseNorm, FlattenAdjacent<n:6>, HeadPrune,
                    NystromMLP) on SmolLM2-135M in memory, fp32, 8 × 512 tokens: FuseNorm changes every layer in
                    place, then the merges and prunes replace 12 layers and the merged ones' linears
  packed_memory     ShortGPT<n:6> in memory, fp32, 8 × 512 tokens, on a packed source: SmolLM2-135M quantized
                    first by recipes/gptq4_smollm2.yaml (W4, groups of 64; 4 × 128 tokens, in the work directory);
                    the row also gives the output's size
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAL = ["--set", "calibration.dataset=wikitext2", "--set", "calibration.split=validation"]
CASES = {
    "sleb_qwen": ("recipes/sleb20_qwen2.5.yaml", [*CAL, "--set", "calibration.samples=4", "--set",
                                                  "calibration.seq_len=512", "--set", "calibration.batch_size=4",
                                                  "--set", "modifiers.0.n=1", "--set", "evaluate=null"]),
    "smollm2_streamed": ("recipes/shortgpt_smollm2.yaml", [*CAL, "--set", "stream='on'", "--set", "dtype=bfloat16",
                                                           "--set", "calibration.samples=8",
                                                           "--set", "evaluate.perplexity.limit=2"]),
    "smollm2_memory": ("recipes/shortgpt_smollm2.yaml", [*CAL, "--set", "stream='off'", "--set", "dtype=bfloat16",
                                                         "--set", "calibration.samples=8",
                                                         "--set", "evaluate.perplexity.limit=2"]),
    "flatten_memory": ("recipes/flatten20_smollm2.yaml", [*CAL, "--set", "calibration.samples=8",
                                                          "--set", "evaluate=null"]),
    "packed_memory": ("recipes/shortgpt_smollm2.yaml", [*CAL, "--set", "stream='off'", "--set", "calibration.samples=8",
                                                        "--set", "evaluate=null", "--set", "model={packed}"]),
}
#: The packed source of ``packed_memory``: the GPTQ recipe's output, made once in the work directory.
PACKED_SOURCE = ("recipes/gptq4_smollm2.yaml", [*CAL, "--set", "calibration.samples=4",
                                                "--set", "calibration.seq_len=128", "--set", "evaluate=null"])


def apply(recipe: str, output: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "recipe_engine.cli", "apply", str(ROOT / recipe), "--output", str(output),
               "--force", "--quiet", *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def run_case(name: str, work: Path) -> dict:
    recipe, overrides = CASES[name]
    if any("{packed}" in o for o in overrides):
        packed = work / "packed_source"
        if not (packed / "report.json").is_file():
            made = apply(*PACKED_SOURCE[:1], packed, PACKED_SOURCE[1])
            if made.returncode != 0:
                return {"case": name, "error": f"the packed source: exit {made.returncode}"}
        overrides = [o.replace("{packed}", str(packed)) for o in overrides]
    output = work / name
    done = apply(recipe, output, overrides)
    if done.returncode != 0:  # recorded: an engine that fails a case says so in the table
        return {"case": name, "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"}
    report = json.loads((output / "report.json").read_text())
    memory = report["peak_memory"]
    return {"case": name, "peak_gib": memory["rss_mib"] / 1024, "plan_gib": memory["estimate_rss_mib"] / 1024,
            "output_mib": sum(f.stat().st_size for f in output.glob("*.safetensors")) / 2**20,
            "steps": [{"step": s["modifier"], "peak_gib": (s["peak_rss_mib"] or 0) / 1024,
                       "plan_gib": (s.get("estimate_rss_mib") or 0) / 1024} for s in report["steps"]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--work", default=None, help="where the outputs go (default: a temporary directory)")
    parser.add_argument("--json", default="benchmarks/results/raw/plan_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        rows = [run_case(name, work) for name in args.cases]
    print(f"{'case':18} {'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:18} {row['error']}")
            continue
        print(f"{row['case']:18} {row['peak_gib']:9.2f} {row['plan_gib']:9.2f} {row['peak_gib'] / row['plan_gib']:9.2f}"
              f"   output {row['output_mib']:.0f} MiB")
        for step in row["steps"]:
            print(f"  step {step['step']:13} {step['peak_gib']:9.2f} {step['plan_gib']:9.2f}")
    path = ROOT / args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": date.today().isoformat(), "machine": platform.platform(),
                                "threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
