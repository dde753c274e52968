"""Subprocess driver for tests/test_distributed.py: one rank of a data-parallel launch running several
``recipe apply`` jobs in turn.

``RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/dp_driver.py JOBS.json``

Imports torch, transformers and the engine once and joins the gloo process group once (the engine reuses an
initialized group), then runs the CLI's ``main`` for each job ``{"name", "argv"}`` with stderr redirected to
``NAME.rank{r}.err``; writes the exit code to ``NAME.rank{r}.rc``. Registers ``FailOnRank``, a model-scope
step, and ``FailInPass``, a layer-scope step failing at layer 1, both raising only on the rank given by
``rank`` (the injected failures of the tests), and the pause points of ``tests/resume_driver.py``: a job with
``"pause"`` (``step``, ``pass``, ``writing``) stops there on every rank that reaches it, with
``NAME.rank{r}.ready`` appearing, for the test to SIGKILL the launch.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import Field

from recipe_engine.cli import main as cli_main
from recipe_engine.recipe.modifier import LayerModifier, Modifier
from recipe_engine.recipe.registry import REGISTRY
from tests.resume_driver import install as install_pause_points


class FailOnRank(Modifier):
    """Raises on rank ``rank`` (a recipe error), does nothing elsewhere."""

    rank: int = Field(1)

    def apply(self, session):
        if int(os.environ["RANK"]) == self.rank:
            raise self.fail(f"injected failure on rank {self.rank}")
        return {}


class FailInPass(LayerModifier):
    """Raises in ``compress_layer`` of layer 1 on rank ``rank``; changes nothing."""

    rank: int = Field(1)

    def target_layers(self, session):
        return list(range(len(session.layers)))

    def compress_layer(self, session, layer_index, stats):
        if layer_index == 1 and int(os.environ["RANK"]) == self.rank:
            raise RuntimeError(f"injected failure in the pass on rank {self.rank}")
        return {}


def main() -> int:
    jobs_file = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    install_pause_points()
    REGISTRY._classes.update(FailOnRank=FailOnRank, FailInPass=FailInPass)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    saved = os.dup(2)
    for job in json.loads(jobs_file.read_text()):
        err = os.open(jobs_file.parent / f"{job['name']}.rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        os.environ.pop("RECIPE_TEST_PAUSE", None)
        if job.get("pause"):
            ready = jobs_file.parent / f"{job['name']}.rank{rank}.ready"
            os.environ.update(RECIPE_TEST_PAUSE=job["pause"], RECIPE_TEST_READY=str(ready))
        try:
            code = cli_main(job["argv"])
        except BaseException as exc:  # noqa: BLE001 - a traceback is a finding: record it as exit 1
            import traceback

            traceback.print_exception(exc)
            code = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(err)
        (jobs_file.parent / f"{job['name']}.rank{rank}.rc").write_text(str(code))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
