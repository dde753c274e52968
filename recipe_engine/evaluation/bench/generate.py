"""One timed request of ``recipe bench``: greedy ``generate`` of exactly ``gen_tokens`` new tokens (static KV
cache in the served mode, the decode step compiled or captured as a CUDA graph where asked), or one forward pass
over the prompt."""
from __future__ import annotations

import time

import torch

from .protocol import Shape
from .timing import Clock, sync


def prompt_ids(vocab_size: int, shape: Shape, device: torch.device) -> torch.Tensor:
    """Seeded random token ids ``[batch, prompt_tokens]`` (speed does not depend on the text)."""
    generator = torch.Generator().manual_seed(shape.prompt_tokens * 1000 + shape.batch)
    return torch.randint(0, vocab_size, (shape.batch, shape.prompt_tokens), generator=generator).to(device)


def generate_options(served: bool, decode_step: str, device: torch.device) -> dict:
    """``generate``'s arguments for the mode. Served = static cache, its one-token decode step ``decode_step``:
    ``compiled`` (``torch.compile(mode="reduce-overhead")`` on CUDA: inductor's kernels, captured once as a CUDA
    graph and replayed), ``graphs`` (``{"graphs": {}}``: the eager kernels captured as a CUDA graph by a
    :class:`StaticGreedy` per request shape, kept there; no inductor, a warm-up of seconds) or ``eager``."""
    if not served:
        return {"disable_compile": True}
    if decode_step == "graphs":
        return {"graphs": {}}
    from transformers import CompileConfig  # deferred: transformers takes seconds to import

    compiled = decode_step == "compiled"
    options: dict = {"cache_implementation": "static", "disable_compile": not compiled}
    if compiled:
        config = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
        config._compile_all_devices = device.type != "cuda"  # transformers compiles on accelerators only otherwise
        options["compile_config"] = config
    return options


class StaticGreedy:
    """Greedy decoding of one request shape over a static KV cache whose one-token step (the forward over the
    whole cache under an additive mask, the argmax, the mask and the position advanced in place) reads and writes
    fixed buffers only, so that ``capture`` records it once as a CUDA graph of the eager kernels and replays it for
    every new token (no inductor: its warm-up is a few eager steps and the capture, not a compile). The prompt's
    forward runs eagerly, as transformers' ``generate`` runs it. The mask is passed as a 4-D tensor, which
    transformers uses as it is, so the step does not depend on how a version builds its masks (some read the
    padding mask on the host, which a capture cannot). Without ``capture`` the same step runs eagerly (the tests
    compare it with ``generate`` and check that it reads nothing on the host)."""

    def __init__(self, model, batch: int, max_len: int, device: torch.device, capture: bool):
        from transformers import StaticCache  # deferred: transformers takes seconds to import

        self.model, self.batch, self.capture = model, batch, capture
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.closed = torch.finfo(model.dtype).min
        self.mask = torch.full((batch, 1, 1, max_len), self.closed, dtype=model.dtype, device=device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = None

    def step(self) -> None:
        """One token: attend to the cache up to ``position``, write the argmax to ``token``, advance."""
        self.mask.index_fill_(-1, self.position, 0)
        logits = self.model(input_ids=self.token, attention_mask=self.mask, past_key_values=self.cache,
                            cache_position=self.position, position_ids=self.position.expand(self.batch, 1),
                            use_cache=True).logits
        self.token.copy_(logits[:, -1:].argmax(-1))
        self.position.add_(1)

    def prefill(self, ids: torch.Tensor) -> None:
        """The prompt's forward into the emptied cache; its argmax is the first new token."""
        prompt = ids.shape[1]
        self.cache.reset()
        logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                            cache_position=torch.arange(prompt, device=ids.device)).logits
        self.token.copy_(logits[:, -1:].argmax(-1))
        self.mask.fill_(self.closed)
        self.mask[..., :prompt] = 0
        self.position.fill_(prompt)

    def replay(self):
        """The decode step to call per token: the captured graph's replay (captured on the first call, after
        three eager steps on a side stream, CUDA's recipe for a capture), else :meth:`step`."""
        if not self.capture:
            return self.step
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.position.zero_()  # slot 0 only; the next request's prefill empties the cache
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
        return self.graph.replay

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, gen_tokens: int, streamer=None) -> torch.Tensor:
        """``ids`` followed by exactly ``gen_tokens`` greedy tokens; ``streamer`` is handed the prompt and then the
        first new token once it is on the host (what :class:`~.timing.Clock` reads)."""
        step = self.replay()
        self.prefill(ids)
        tokens = [self.token.clone()]
        if streamer is not None:
            streamer.put(ids)
            streamer.put(self.token.cpu())
        for _ in range(gen_tokens - 1):
            step()
            tokens.append(self.token.clone())
        return torch.cat([ids, *tokens], dim=1)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, gen_tokens: int, options: dict, streamer=None) -> torch.Tensor:
    """Exactly ``gen_tokens`` greedy tokens after ``ids`` (no end-of-sequence stop)."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_tokens,
                          min_new_tokens=gen_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                          pad_token_id=0, eos_token_id=None, streamer=streamer, **options)


@torch.no_grad()
def time_request(model, shape: Shape, device: torch.device, options: dict) -> dict:
    """Seconds of one request; for a generation also the time to the first token and the decode window
    (perf_counter start and end, for the GPU's busy share)."""
    ids = prompt_ids(model.config.vocab_size, shape, device)
    sync(device)
    if not shape.gen_tokens:
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        sync(device)
        return {"seconds": time.perf_counter() - start}
    clock = Clock()
    decoder = None
    if "graphs" in options:  # one StaticGreedy per model and request shape, built (and captured) on its first run
        key = (id(model), shape.batch, shape.prompt_tokens + shape.gen_tokens)
        if key not in options["graphs"]:
            options["graphs"][key] = StaticGreedy(model, shape.batch, key[2], device, device.type == "cuda")
        decoder = options["graphs"][key]
    start = time.perf_counter()
    out = decoder(ids, shape.gen_tokens, clock) if decoder else greedy(model, ids, shape.gen_tokens, options, clock)
    sync(device)
    end = time.perf_counter()
    assert out.shape == (shape.batch, shape.prompt_tokens + shape.gen_tokens), out.shape
    first = clock.first_token
    return {"seconds": end - start, "first_token_s": first - start, "decode_s": end - first,
            "decode_window": (first, end)}
