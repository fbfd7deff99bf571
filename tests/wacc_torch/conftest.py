"""Fixtures shared by the wacc_torch tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
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
