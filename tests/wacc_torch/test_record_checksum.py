"""Record files with flipped bytes never load different pending values without complaint.

``torch.load`` does not check the zip entries' CRC-32, so before records carried a checksum a
flipped byte in a buffer's bytes loaded silently (about 1 flip in 4 on this record). Now every
flip is either refused with RecordError or leaves what loads identical (zip metadata such as the
stored CRC or the serialization id).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.wacc_torch.support import assert_records_equal
from wacc_torch import RecordError, WeightedGradientsAccumulator, load_record, save_record

FLIPS = 1500


def _module() -> nn.Module:
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(16, 8))
    module.b = nn.Parameter(torch.zeros(8))
    return module


@pytest.mark.slow
def test_flipped_bytes_are_refused_or_harmless(tmp_path: Path) -> None:
    """Each of FLIPS random single-byte flips of a record file is refused or loads the same."""
    generator = torch.Generator().manual_seed(0)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0)
    accumulator.accumulate_sum(
        _module(),
        3,
        grads={
            "w": torch.randn(16, 8, generator=generator),
            "b": torch.randn(8, generator=generator),
        },
    )
    accumulator.accumulate_sum(_module(), 0, grads={})
    original = accumulator.state_dict()
    path = tmp_path / "record.pt"
    save_record(original, path)
    data = path.read_bytes()
    rng = random.Random(0)
    refused = 0
    for _ in range(FLIPS):
        damaged = bytearray(data)
        damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(damaged))
        target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0)
        try:
            target.load_state_dict(load_record(path), _module())
        except RecordError:
            refused += 1
            continue
        assert_records_equal(target.state_dict(), original)  # loaded: then nothing changed
    # The buffers' bytes are about a quarter of the file: many flips must have been refused.
    assert refused > FLIPS // 4
