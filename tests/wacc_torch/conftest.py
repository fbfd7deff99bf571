"""Fixtures shared by the wacc_torch tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

# DistributedDataParallel imports torch._dynamo the first time one is built (5 to 10 s on these
# machines), inside whichever test comes first.  Imported here, that one-time cost is paid at
# collection: a test's time no longer depends on its place in the run, and a process forked after
# collection (mutmut's workers, whose timeouts come from the warm times) does not pay it again.
import torch._dynamo  # noqa: F401  (imported for its cost, see above)
import torch.distributed as dist


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real single-process gloo group (world size 1), destroyed afterwards; the test's DDP
    models (they sit in reference cycles) are collected first, while their group still lives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()
