"""The ``shapes`` and ``decoder`` suites: the listed layer sets and a quick run of each."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import decoder, shapes
from benchmarks.bandwidth import D2D, bandwidth_rows
from benchmarks.settings import Settings

QUICK = Settings(quick=True, devices=(torch.device("cpu"),), repeats=1, out=Path("unused"))


def test_the_layer_sets_have_the_published_parameter_counts() -> None:
    """GPT-2 small 124 439 808 (Hugging Face), ViT-B/16 86 567 656 (torchvision), one Llama-7B
    decoder layer with its token embedding 333 455 360 (= 131 072 000 + 4 x 4096**2 + 3 x
    4096 x 11008 + 2 x 4096); a scale keeps that fraction of layers and vocabulary rows."""
    assert shapes.gpt2_small().numel == 124_439_808
    assert shapes.vit_b16().numel == 86_567_656
    assert shapes.llama_layer().numel == 333_455_360
    quarter = shapes.gpt2_small(0.25)
    assert quarter.ran == "3/12 layers, 12564/50257 vocabulary rows, d=768"
    assert dict(quarter.shapes)["wte"] == (12564, 768)
    assert shapes.llama_layer(0.5).ran.startswith("1 layer, 16000/32000 embedding rows")
    assert "124.4 M parameters" in shapes.gpt2_small().case


def test_quick_shapes_rows_cover_every_case_and_mode() -> None:
    """A quick run gives, per layer set, the floor, the seven buffered modes and the plain loop's
    add-and-free, the plain backward and two zero-copy blocks, and four memory rows, then the
    piece sizes of both mean paths; the zero-copy memory of a mean is the plain backward's (no
    work tensor when autograd's gradient is owned)."""
    rows = shapes.run(QUICK)
    assert len(rows) == 3 * (9 + 3 + 4) + 5
    pieces = [row for row in rows if row.case.startswith("piece size")]
    assert [row.mode for row in pieces] == [
        shapes.FLOOR,
        "accumulate_mean (grads=), pieces of 2**10",
        "accumulate_mean (grads=), pieces of 2**12",
        "accumulate_mean (.grad), pieces of 2**10",
        "accumulate_mean (.grad), pieces of 2**12",
    ]
    modes = {row.mode for row in rows}
    assert {
        shapes.FLOOR,
        "accumulate_sum (grads=)",
        "accumulate_mean (grads=)",
        "accumulate_mean fused (grads=)",
        "accumulate_sum (.grad)",
        "accumulate_mean (.grad)",
        "accumulate_mean (.grad, disposable)",
        "finish_mean",
        shapes.PLAIN_ADD,
        shapes.PLAIN,
        "zero-copy block (mean)",
        "zero-copy block (sum)",
        "wacc-zero-copy mean",
        "wacc-buffered mean",
    } <= modes
    for row in rows:
        assert row.value is not None and row.value > 0
        assert (row.ratio is None) == (row.floor == "")
    memory = [row for row in rows if row.mode == "wacc-zero-copy mean"]
    assert len(memory) == 3 and all(row.ratio == 1.0 and row.met == "yes" for row in memory)


def test_quick_decoder_step_times_every_mode_against_the_plain_loop() -> None:
    """A quick run of the decoder step: the plain loop and four accumulator modes, each a ratio
    to the plain loop; the model is a causal decoder that trains (its loss is finite)."""
    rows = decoder.run(QUICK)
    assert [row.mode for row in rows] == list(decoder.MODES)
    assert all(row.value is not None and row.value > 0 for row in rows)
    assert rows[0].ratio is None and all(row.ratio is not None for row in rows[1:])
    model = decoder.Decoder(decoder.QUICK)
    batch = decoder.make_batches(decoder.QUICK, torch.device("cpu"))[0]
    # Causal: the logits at a position do not depend on later tokens.
    ids = batch[0].clone()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % decoder.QUICK.vocab
    with torch.no_grad():
        assert torch.allclose(model(ids)[:, :-1], model(changed)[:, :-1], rtol=0, atol=1e-6)


def test_bandwidth_rows_count_each_modes_passes_against_a_copy() -> None:
    """The shapes suite's GB/s rows (CUDA's; the arithmetic is the device's own, so checked on
    the CPU): per mode timed, its passes (4 where the product is written into the gradient) x
    bytes / seconds, and its ratio to the copy's 2 x bytes / seconds; a mode not timed gets no
    row."""
    bufs = [torch.zeros(1000), torch.zeros(24, 10)]  # 4960 bytes
    medians = {shapes.FLOOR: 1e-6, "finish_mean": 2e-6, "accumulate_mean (.grad, disposable)": 4e-6}
    rows = bandwidth_rows(
        shapes.SUITE, "set", torch.device("cpu"), bufs, medians, shapes.TRAFFIC, repeats=3
    )
    copy, *timed = rows
    assert copy.mode == D2D and copy.unit == "GB/s" and copy.ratio is None
    nbytes = 1240 * 4
    expected = {shapes.FLOOR: 3 * nbytes / 1e-6 / 1e9, "finish_mean": 2 * nbytes / 2e-6 / 1e9}
    expected["accumulate_mean (.grad, disposable)"] = 4 * nbytes / 4e-6 / 1e9
    assert {row.mode: row.value for row in timed} == expected
    for row in timed:
        assert row.floor == D2D and row.ratio == row.value / copy.value


def test_a_layer_set_measured_in_a_fresh_process_gives_its_rows() -> None:
    """``in_fresh_process`` (how a full run measures each layer set) runs the set in a spawned
    interpreter and hands back the same rows, measured there, as in this process."""
    layer_set = shapes.layer_sets(1.0, quick=True)[0]
    cpu = torch.device("cpu")
    here = shapes._set_rows(layer_set, 1, cpu)
    there = shapes.in_fresh_process(shapes._set_rows, layer_set, 1, cpu)
    assert [(r.case, r.mode, r.unit, r.floor) for r in there] == [
        (r.case, r.mode, r.unit, r.floor) for r in here
    ]
    assert all(r.value is not None and r.value > 0 for r in there)
    memory = [(r.mode, r.value) for r in there if r.unit == "MiB"]
    assert memory == [(r.mode, r.value) for r in here if r.unit == "MiB"]  # bytes: exact
