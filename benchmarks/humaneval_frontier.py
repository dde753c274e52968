"""The HumanEval frontier of Qwen2.5-Coder-0.5B-Instruct: pass@1 against size across depth, width and bits, and
how well the cheap agreement score ranks it.

    # one row: a compressed output, its `recipe eval --tasks humaneval --json` record and its
    # `recipe eval --agreement dense.json --json` record
    python -m benchmarks.humaneval_frontier row "WidthPrune<intermediate_size:3744>" --kind width \\
        --calibration "code sample" --output OUT --eval OUT.json --agreement OUT.agree.json \\
        --command "recipe apply w20code.yaml && ..." --conditions "..."
    # the rank correlation and the plot (docs/images/humaneval_frontier.png) from the stored rows
    python -m benchmarks.humaneval_frontier render

Sizes come from the checkpoint's safetensors headers and its small ``weight_shape`` tensors (no weight is
loaded), **counted as served in bf16**: every floating-point tensor at 2 bytes (the checkpoints hold fp32, the
CPU evaluation's dtype), integer tensors (packed codes, zero points) as stored. Per row:

- decoder parameters: every tensor under ``model.layers.``, a packed linear by its logical rows × columns, as a
  share of the dense model's;
- bits per weight of the decoder's linears: their stored bits (codes, scales, zero points; unquantized: 16)
  over their logical weights;
- bytes read per decoded token: every weight a decode step reads, all tensors but the input embeddings (a
  tied head counts them once), the memory-bound cost of a token (``recipe bench``'s definition);
- pass@1 (all 164 problems, our sandbox, checked against OpenAI's checker by
  ``benchmarks/humaneval_openai_check.py``) and the share of the dense model's;
- the agreement score (``recipe eval --agreement``): NLL of the dense model's completions, token agreement.

``render`` computes Spearman's ρ between −NLL and pass@1 over the rows with both (scipy's ``spearmanr``, ties
averaged), writes it into the results file and draws pass@1 against bytes read per token.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import rowstore

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results" / "humaneval_frontier.json"
IMAGE = ROOT / "docs" / "images" / "humaneval_frontier.png"
SECTION, ORDER = "Qwen2.5-0.5B: the HumanEval frontier", 20.6
TITLE = "HumanEval pass@1 against size: depth, width and bits"
SCORE_TITLE = "The agreement score against pass@1"
DENSE = "dense"

COLUMNS = [("model", "model"), ("kind", "kind"), ("calibration", "calibration"), ("params", "decoder params"),
           ("bits", "bits / weight (linears)"), ("written_bits", "bits / weight as written"),
           ("read_mb", "MB read / token (bf16)"),
           ("checkpoint_mb", "checkpoint MB (bf16)"), ("passed", "passed"), ("share", "share of dense"),
           ("nll", "agreement NLL"), ("agree", "token agreement")]
INTRO = ("Qwen2.5-Coder-0.5B-Instruct (builtin `qwen2.5-0.5b`), every output measured on all 164 HumanEval "
         "problems (greedy, 300 new tokens, our sandbox; OpenAI's checker agrees on every row). Sizes from the "
         "checkpoint's safetensors headers, counted as served in bf16 (floating-point tensors at 2 bytes, packed "
         "integers as stored): decoder parameters as a share of the dense model's, stored bits per weight of the "
         "decoder's linears (codes, 16-bit scales, zero points) and, beside it, as written in the file (the "
         "figure the bits goal counts: fp32 scales where a float32 run kept the default `scale_dtype: model`, "
         "0.125 bits more at groups of 128; as the report's `bits_per_weight`; unquantized fp32 rows are 32, "
         "shown only for the rows measured since the column was added), and bytes a decode step reads "
         "(every weight but the input embeddings). Agreement: each model's NLL of the dense model's own "
         "completions of the last 40 problems, and the share of those tokens it would pick greedily "
         "(`recipe eval --agreement dense.json --agreement-problems 40`, one forward per problem, nothing "
         "generated or run). Made by `benchmarks/humaneval_frontier.py`.")

FLOATS = {"F64": 2, "F32": 2, "F16": 2, "BF16": 2}  # bytes per element as served in bf16
WRITTEN = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # bytes per element in the file
INTS = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_sizes(directory: Path) -> dict:
    """Sizes of a checkpoint directory as served in bf16 (see the module): decoder parameters, the decoder
    linears' stored bits per weight, all bytes and the bytes one decode step reads."""
    from safetensors import safe_open

    config = json.loads((directory / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, tuple[str, list[int]]] = {}
    shapes: dict[str, list[int]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                tensors[name] = (piece.get_dtype(), list(piece.get_shape()))
                if name.endswith(".weight_shape"):
                    shapes[name[:-len(".weight_shape")]] = handle.get_tensor(name).tolist()

    def stored(name: str, floats: dict[str, int] = FLOATS) -> int:
        dtype, shape = tensors[name]
        count = 1
        for size in shape:
            count *= size
        return count * (floats.get(dtype) or INTS[dtype])

    total = sum(stored(name) for name in tensors)
    embeddings = stored("model.embed_tokens.weight") if "model.embed_tokens.weight" in tensors else 0
    read = total - (0 if tied else embeddings)
    decoder_parameters, linear_bits, linear_weights, written_bits = 0, 0, 0, 0
    for name, (dtype, shape) in tensors.items():
        if not name.startswith("model.layers."):
            continue
        module, _, part = name.rpartition(".")
        if part in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            if part == "weight_packed":
                rows, columns = shapes[module]
                decoder_parameters += rows * columns
                linear_weights += rows * columns
            if part != "weight_shape":  # a shape record, not the weight (``Exporter.metadata``)
                linear_bits += 8 * stored(name)
                written_bits += 8 * stored(name, WRITTEN)
            continue
        count = 1
        for size in shape:
            count *= size
        decoder_parameters += count
        if part == "weight" and len(shape) == 2:
            linear_weights += count
            linear_bits += 8 * stored(name)
            written_bits += 8 * stored(name, WRITTEN)
    return {"decoder_parameters": decoder_parameters, "bits_per_weight": linear_bits / linear_weights,
            "written_bits_per_weight": written_bits / linear_weights,
            "checkpoint_bytes": total, "read_bytes": read}


def load_rows() -> dict:
    return rowstore.load_file(RESULTS, SECTION, ORDER)


def table(data: dict, title: str) -> dict:
    for existing in data.setdefault("tables", []):
        if existing["title"] == title:
            return existing
    data["tables"].append({"title": title, "columns": [], "rows": []})
    return data["tables"][-1]


def cells(raw: dict, dense: dict | None) -> dict:
    """The table's cells of one row's raw figures."""
    share = raw["passed"] / dense["passed"] if dense else 1.0
    params = raw["decoder_parameters"] / dense["decoder_parameters"] if dense else 1.0
    return {"model": raw["model"], "kind": raw["kind"], "calibration": raw["calibration"],
            "params": f"{100 * params:.1f} %", "bits": f"{raw['bits_per_weight']:.2f}",
            "written_bits": f"{raw['written_bits_per_weight']:.2f}" if "written_bits_per_weight" in raw else "–",
            "read_mb": f"{raw['read_bytes'] / 1e6:,.0f}", "checkpoint_mb": f"{raw['checkpoint_bytes'] / 1e6:,.0f}",
            "passed": f"{raw['passed']} / {raw['problems']}", "share": f"{100 * share:.0f} %",
            "nll": "–" if raw.get("nll") is None else f"{raw['nll']:.3f}",
            "agree": "–" if raw.get("token_agreement") is None else f"{100 * raw['token_agreement']:.1f} %"}


def add_row(args) -> None:
    if args.eval:
        record = json.loads(Path(args.eval).read_text())["generation"]["tasks"]["humaneval"]
    elif args.passed is not None:  # measured before, by the HumanEval table's run (named in --conditions)
        record = {"passed": args.passed, "samples": 164}
    else:
        sys.exit("give --eval (a humaneval record) or --passed (pass count measured by another run)")
    raw = {"model": args.name, "kind": args.kind, "calibration": args.calibration, "passed": record["passed"],
           "problems": record["samples"], **checkpoint_sizes(Path(args.output))}
    if args.agreement:
        agreement = json.loads(Path(args.agreement).read_text())["agreement"]["tasks"]["humaneval"]
        raw.update(nll=agreement["nll"], token_agreement=agreement["token_agreement"],
                   agreement_problems=agreement["problems"])
    if record["samples"] != 164:
        sys.exit(f"{args.eval}: {record['samples']} problems; the frontier measures all 164")
    run = rowstore.run_record(conditions=args.conditions, argv=args.command.split() if args.command else None)
    if args.command:
        run["command"] = args.command
    with rowstore.exclusive(RESULTS):
        data = load_rows()
        run_id = rowstore.add_run(data, run)
        raws = data.setdefault("raw", [])
        raws[:] = [r for r in raws if r["model"] != args.name] + [{**raw, "run": run_id}]
        rebuild(data)
        rowstore.save(RESULTS, data)
    print(json.dumps(raw, indent=1))


def spearman(raws: list[dict]) -> tuple[float, float, int]:
    from scipy.stats import spearmanr

    scored = [r for r in raws if r.get("nll") is not None]
    result = spearmanr([-r["nll"] for r in scored], [r["passed"] for r in scored])
    return float(result.statistic), float(result.pvalue), len(scored)


def rebuild(data: dict) -> None:
    """The two tables from the raw rows: the frontier (dense first, then by bytes read per token, largest first)
    and the rank correlation."""
    raws = data.get("raw", [])
    dense = next((r for r in raws if r["kind"] == DENSE), None)
    ordered = sorted(raws, key=lambda r: (r["kind"] != DENSE, -r["read_bytes"], -r["passed"]))
    frontier = table(data, TITLE)
    frontier.update(intro=INTRO, columns=[{"key": k, "label": label} for k, label in COLUMNS],
                    rows=[{**cells(r, dense), "run": r["run"]} for r in ordered])
    image = (f"pass@1 against the bytes a decoded token reads: "
             f"![pass@1 against bytes read per token]({IMAGE.relative_to(ROOT).as_posix()})")
    frontier["notes"] = [image] + [n for n in frontier.get("notes", []) if not n.startswith("pass@1 against")]
    if sum(r.get("nll") is not None for r in raws) >= 3:
        rho, p, n = spearman(raws)
        score = table(data, SCORE_TITLE)
        score.update(intro=("Spearman's rank correlation between the agreement score (−NLL of the dense model's "
                            "completions) and pass@1, over the frontier's rows that have both (scipy's `spearmanr`, "
                            "ties averaged)."),
                     columns=[{"key": "rows", "label": "rows"}, {"key": "rho", "label": "Spearman ρ"},
                              {"key": "p", "label": "p-value"}],
                     rows=[{"rows": str(n), "rho": f"{rho:.3f}", "p": f"{p:.2g}",
                            "run": sorted({r["run"] for r in raws if r.get("nll") is not None})}])


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raws = data.get("raw", [])
    markers = {"dense": "*", "depth": "v", "width": "s", "bits": "o", "width + bits": "D", "depth + bits": "P",
               "mixed bits": "h"}
    figure, axis = plt.subplots(figsize=(8, 5), dpi=110)
    for kind in dict.fromkeys(r["kind"] for r in raws):
        rows = [r for r in raws if r["kind"] == kind]
        axis.scatter([r["read_bytes"] / 1e6 for r in rows], [r["passed"] / r["problems"] for r in rows],
                     marker=markers.get(kind, "x"), s=70, label=kind)
        for r in rows:
            axis.annotate(r["model"][:28], (r["read_bytes"] / 1e6, r["passed"] / r["problems"]), fontsize=6,
                          xytext=(4, 3), textcoords="offset points")
    axis.set_xlabel("MB read per decoded token (bf16; packed integers as stored)")
    axis.set_ylabel("HumanEval pass@1 (164 problems)")
    axis.set_title("Qwen2.5-Coder-0.5B-Instruct: quality against memory traffic")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(IMAGE)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command_name", required=True)
    row = sub.add_parser("row", help="measure one output and store its row")
    row.add_argument("name")
    row.add_argument("--kind", required=True, help="dense, depth, width, bits, width + bits, mixed bits, ...")
    row.add_argument("--calibration", default="–")
    row.add_argument("--output", required=True, help="the checkpoint directory")
    row.add_argument("--eval", help="its `recipe eval --tasks humaneval --json` record")
    row.add_argument("--passed", type=int, help="instead of --eval: the problems (of 164) it passed when the "
                                                "same recipe was measured before (say which run in --conditions)")
    row.add_argument("--agreement", help="its `recipe eval --agreement DENSE.json --json` record")
    row.add_argument("--command", help="the commands that made the row (stored as the run's command)")
    row.add_argument("--conditions", help="what else ran, thread counts")
    sub.add_parser("render", help="recompute the tables and draw the plot")
    args = parser.parse_args(argv)
    if args.command_name == "row":
        add_row(args)
    else:
        with rowstore.exclusive(RESULTS):
            data = load_rows()
            rebuild(data)
            rowstore.save(RESULTS, data)
        plot(data)
        print(f"wrote {RESULTS.relative_to(ROOT)} and {IMAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
