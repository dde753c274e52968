"""How a run ends on an exception: which resume checkpoints stay (``discard_on_error``), and a failed allocation
said in one line that names where the run was (``out_of_memory_named``)."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from ..errors import OutOfMemory, allocation_detail, memory_kind
from ..system.progress import Progress
from .distributed import RankFailed


@contextlib.contextmanager
def discard_on_error(owned: list) -> Iterator[None]:
    """Remove the checkpoints in ``owned`` (``resume.Checkpoints``, appended once a run adopted them) when the
    block raises: an exception or a handled signal leaves nothing behind. A hard kill, and running out of memory
    (``OutOfMemory``, or under data parallelism another rank's ``RankFailed`` saying so: the OOM killer's SIGKILL
    would have left them too), leave the complete checkpoints to resume."""
    try:
        yield
    except (OutOfMemory, RankFailed) as exc:
        _discard(owned, keep_resumable=isinstance(exc, OutOfMemory) or exc.out_of_memory)
        raise
    except BaseException:
        _discard(owned)
        raise


def _discard(owned: list, keep_resumable: bool = False) -> None:
    for checkpoints in owned:
        if checkpoints is not None and not (keep_resumable and checkpoints.resumable):
            checkpoints.discard()


@contextlib.contextmanager
def out_of_memory_named(progress: Progress, resumable: Callable[[], bool]) -> Iterator[None]:
    """A failed allocation in the block becomes ``OutOfMemory``: where the run was (``Progress.where``), torch's
    words, whether the run's checkpoints let ``--resume`` go on (``discard_on_error`` keeps them) and what to
    change to need less."""
    try:
        yield
    except Exception as exc:
        memory = memory_kind(exc)
        if memory is None:
            raise
        kept, where = resumable(), progress.where()
        if progress.evaluating:  # evaluate_model: the whole model there
            less = "stream: on (evaluates one layer at a time) or a shorter evaluate.perplexity.seq_len"
        elif memory == "GPU":
            less = "a smaller calibration.batch_size or calibration.offload: true (activations on the host)"
        else:
            less = "a smaller calibration.batch_size or stream: on (one layer in memory at a time)"
        fragments = (" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation)" if memory == "GPU"
                     else "")
        advice = (f"the resume checkpoints are kept: once memory is free, rerun with --resume{fragments}; or start "
                  f"over needing less: {less}" if kept else f"nothing was written; to need less: {less}")
        raise OutOfMemory(memory, allocation_detail(exc), where, advice, kept) from exc
