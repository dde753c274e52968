"""What ``recipe bench`` times: the shapes of each protocol, per mode and device, and how they differ from
the papers'.

* ``served`` (default): greedy ``generate`` over a static KV cache; on a GPU its one-token decode step is
  compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs replayed each step), as serving engines
  run a model. Two requests: *throughput*, SLEB's shape (batch 64, 64-token prompts, 128 new tokens), and
  *latency*, batch 1 after a 2048-token prefill (128 new tokens).
* ``eager``: FlattenGPT Appendix C.2 as first implemented: eager ``generate`` (dynamic cache) of 128 tokens for
  64 one-token prompts, and the latency of one forward pass over a 2048-token sequence.

On CPU the shapes are smaller (a 2-core machine takes minutes per paper-sized request); every difference
from the paper's protocol is printed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

MODES = ("served", "eager")


@dataclass(frozen=True)
class Shape:
    """One timed request: ``batch`` prompts of ``prompt_tokens`` tokens, ``gen_tokens`` new tokens each
    (``gen_tokens`` 0: one forward pass over the prompt, no generation)."""

    name: str
    batch: int
    prompt_tokens: int
    gen_tokens: int


#: The papers' shapes: SLEB's generation (FlattenGPT Table 2 reuses it) and FlattenGPT C.2's.
PAPER = {"served": (Shape("throughput", 64, 64, 128), Shape("latency", 1, 2048, 128)),
         "eager": (Shape("generation", 64, 1, 128), Shape("prefill", 1, 2048, 0))}
#: The CPU's defaults: the same requests, sized for a few cores.
CPU = {"served": (Shape("throughput", 8, 64, 32), Shape("latency", 1, 256, 32)),
       "eager": (Shape("generation", 8, 1, 32), Shape("prefill", 1, 512, 0))}


def shapes(mode: str, on_gpu: bool, batch: int | None = None, prompt_tokens: int | None = None,
           gen_tokens: int | None = None, prefill_tokens: int | None = None) -> tuple[Shape, Shape]:
    """The two requests of ``mode`` on this device, with the command line's sizes (None: the default).
    ``batch`` and ``prompt_tokens`` size the first request, ``prefill_tokens`` the second's prompt,
    ``gen_tokens`` both (not the eager prefill, which generates nothing)."""
    first, second = (PAPER if on_gpu else CPU)[mode]
    first = replace(first, batch=batch or first.batch, prompt_tokens=prompt_tokens or first.prompt_tokens,
                    gen_tokens=gen_tokens or first.gen_tokens)
    second = replace(second, prompt_tokens=prefill_tokens or second.prompt_tokens,
                     gen_tokens=(gen_tokens or second.gen_tokens) if second.gen_tokens else 0)
    return first, second


def protocol_differences(mode: str, used: tuple[Shape, Shape], device_type: str, graphs: bool,
                         repeats: int) -> list[str]:
    """Each way this run differs from the paper's protocol of ``mode`` (empty: it matches)."""
    notes = [f"device {device_type} (paper: GPU)"] if device_type != "cuda" else []
    papers = {shape.name: shape for shape in PAPER[mode]}
    for ours in used:
        paper = papers[ours.name]
        for field in ("batch", "prompt_tokens", "gen_tokens"):
            if getattr(ours, field) != getattr(paper, field):
                notes.append(f"{ours.name} {field.replace('_', ' ')} {getattr(ours, field)} "
                             f"(paper {getattr(paper, field)})")
    if mode == "served" and not graphs:
        notes.append("decode step not compiled (served: CUDA graphs of the decode step)")
    if repeats < 30:
        notes.append(f"{repeats} timed iterations (30 or more for a median and p90)")
    return notes


def protocol_note(mode: str, used: tuple[Shape, Shape], device_type: str, graphs: bool,
                  repeats: int) -> str | None:
    """One line saying how the run differs from the paper's protocol (None when it matches); ``graphs``: the
    decode step replayed as CUDA graphs (compiled, or captured from the eager kernels)."""
    notes = protocol_differences(mode, used, device_type, graphs, repeats)
    paper = "SLEB / FlattenGPT Table 2" if mode == "served" else "FlattenGPT C.2"
    return f"differs from {paper}: " + ", ".join(notes) if notes else None
