"""Two gloo processes started by the tests with ``torch.multiprocessing`` (spawn)."""

import os
import sys

import torch.multiprocessing as mp


def _leave_after(rank, fn, *args):
    """Run ``fn(rank, *args)``, then leave without interpreter finalisation, as
    ``sae.mesh.exit_worker`` does for torchrun workers (a gloo thread still releasing the
    last collective's tensors would abort a finalising interpreter). An exception in
    ``fn`` propagates, so ``start_processes`` reports it."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_two(fn, *args) -> None:
    """``fn(rank, *args)`` on ranks 0 and 1 in spawned processes; raises if either fails."""
    mp.start_processes(_leave_after, args=(fn, *args), nprocs=2, join=True, start_method="spawn")
