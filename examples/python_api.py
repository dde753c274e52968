"""The Python API on the default model: run a recipe in memory, inspect the report, save, reload.

    python examples/python_api.py [recipes/fusenorm_smollm2.yaml]
"""
import sys

import torch

import recipe_engine

recipe_path = sys.argv[1] if len(sys.argv) > 1 else "recipes/fusenorm_smollm2.yaml"

# 1. Run the recipe without writing anything; overrides use the same syntax as `recipe apply --set`.
model, report = recipe_engine.apply(recipe_path, overrides=["calibration.samples=4", "calibration.seq_len=128",
                                                            "evaluate.perplexity.limit=2"], write=False)
print(f"layers {report.before.layers} -> {report.after.layers}, "
      f"parameters {report.before.parameters:,} -> {report.after.parameters:,}")
for when in ("before", "after"):
    ppl = (getattr(report.evaluation, when) or {}).get("perplexity") if report.evaluation else None
    if ppl:
        print(f"PPL {when}: {ppl['ppl']:.2f} on {ppl['windows']} windows of {ppl['origin']}")

# 2. Or write the checkpoint and load it back (stock from_pretrained works; load_model also restores
#    non-stock extras such as a LinearPatch).
_, report = recipe_engine.apply(recipe_path, overrides=["calibration.samples=4", "calibration.seq_len=128",
                                                        "output=out/python_api_example"],
                                force=True, progress=False)
reloaded, tokenizer = recipe_engine.load_model("out/python_api_example")
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    print("next token:", tokenizer.decode(reloaded(ids).logits[0, -1].argmax()))
