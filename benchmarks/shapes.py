"""Suite ``shapes``: the accumulator on the parameter shapes of models people train.

Three layer sets, listed from their configurations (no weights, no ``transformers``):

- ``gpt2-small``: 12 layers, d = 768, vocabulary 50257, 1024 positions (124.4 M parameters);
- ``llama-7b layer``: one decoder layer (d = 4096, feed-forward 11008, no biases) and the token
  embedding (vocabulary 32000): 333.6 M parameters;
- ``vit-b/16``: 12 layers, d = 768, MLP 3072, 16 x 16 patches of a 224 px image, 1000 classes
  (86.6 M parameters).

``--shape-scale F`` keeps ``round(F * layers)`` layers (at least one) and ``round(F * rows)`` rows
of each vocabulary-sized matrix; each row's case says what ran. Per layer set, all in float32:

- ``accumulate_sum``, ``accumulate_mean`` (reproducible, and fused) with ``grads=`` (tensors the
  caller keeps), and ``accumulate_mean`` on the ``.grad`` it takes from the module; each call of
  a window already under way, against one ``torch._foreach_add_(bufs, grads, alpha=w)`` (the
  ``large`` suite's floor), in the same interleaved run. ``finish_mean`` is timed alone, after a
  fresh window was filled (untimed).
- zero-copy blocks (``kind="mean"`` and ``"sum"``) around a backward that hands each parameter
  its gradient, against the same backward accumulating into ``.grad`` (plain autograd).
- peak gradient memory of a two-microbatch window, per mode, against the plain backward's.

And the piece size: a reproducible mean of a gradient the accumulator does not own goes through
a work tensor piece by piece (``wacc_torch._work.CHUNK_ELEMENTS``); ``piece size`` rows time it
on one 4096 x 4096 matrix for pieces of 2**14 to 2**24 elements, to choose that constant from a
quiet machine's figures.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from benchmarks.bandwidth import bandwidth_rows
from benchmarks.features import pending_buffers
from benchmarks.memory import StorageLog
from benchmarks.results import Row
from benchmarks.settings import Settings
from benchmarks.timing import Timed, interleaved_medians, ratio
from wacc_torch import WeightedGradientsAccumulator, _work

SUITE = "shapes"
FLOOR = "_foreach_add_(alpha=w)"
PLAIN = "plain backward into .grad"
PLAIN_ADD = "plain loop's .grad += g, g freed"
CPU = torch.device("cpu")
WEIGHT = 3.0
MIB = 2**20
# The targets (issue 21): the two-pass limit of a reproducible mean is about 1.63x.
TARGETS = {
    "accumulate_mean (.grad)": 1.7,
    "accumulate_mean (grads=)": 1.7,
    "accumulate_mean fused (grads=)": 1.05,
    "accumulate_sum (grads=)": 1.05,
}
MEMORY_TARGETS = {"wacc-zero-copy mean": 1.0, "wacc-zero-copy sum": 1.0}
NOTES = (
    "Float32 parameter shapes of GPT-2 small, one Llama-7B decoder layer with its token "
    "embedding, and ViT-B/16 (the case names what ran: layers kept, vocabulary rows, parameter "
    "count; `--shape-scale` scales both down), each set measured in a process of its own. "
    "Accumulate rows: median seconds per call of a "
    "window under way; ratio = mode / one `torch._foreach_add_(bufs, grads, alpha=w)` over the "
    "same tensors in the same run. `(grads=)` hands in tensors the caller keeps; `(.grad)` lets "
    "the accumulator take each `.grad` (set, untimed, before each call) and drop it "
    "(`accumulate_sum (.grad)`: the cost of taking and freeing them). `plain loop's .grad += g, "
    "g freed` is what a plain loop's autograd does with a later microbatch's gradient (adds the "
    "incoming tensor into `.grad`, then frees it): the free the `(.grad)` rows pay, a plain loop "
    "pays inside its backward. Either way the product of "
    "a reproducible mean goes through a piece-sized work tensor, except in `(.grad, disposable)`: "
    "`accumulate_mean(..., disposable=True)` writes it into each `.grad` it takes (no work "
    "tensor). `finish_mean` is timed alone after a window was filled. Zero-copy "
    "rows: median seconds of a backward handing each parameter its gradient (`p * 1.0`, graph "
    "built untimed) inside a `microbatch` block, ratio = mode / the same backward accumulating "
    "into `.grad`; there the product is written into autograd's own gradient (no work tensor). "
    "Memory rows: peak gradient memory of a two-microbatch window (the `memory` suite's "
    "definition), ratio = mode / that plain backward. `piece size` rows: `accumulate_mean` on "
    "one 4096 x 4096 matrix with its pieces set to 2**k elements (the shipped size is 2**20; "
    "2**24 is the whole matrix at once), handed in `(grads=)` and taken `(.grad)`. On CUDA, "
    "`: GB/s` rows give each accumulate row's rate (the passes over the gradients it must move: "
    "3, 4 when the product is written into the gradient, 2 for `finish_mean`) against a "
    "device-to-device copy of the buffers."
)


@dataclass(frozen=True)
class LayerSet:
    """A model's parameter shapes (name -> shape) and what of it ran."""

    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    ran: str

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for _, shape in self.shapes)

    @property
    def case(self) -> str:
        return f"{self.name} ({self.ran}; {self.numel / 1e6:.1f} M parameters)"


def _kept(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def gpt2_small(scale: float = 1.0, *, d: int = 768, layers: int = 12) -> LayerSet:
    """GPT-2 small (Hugging Face's parameter names; Conv1D weights are (in, out))."""
    vocab, positions = 50257, 1024
    kept, rows = _kept(layers, scale), _kept(vocab, scale)
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (rows, d)), ("wpe", (positions, d))]
    for i in range(kept):
        shapes += [
            (f"h.{i}.ln_1.weight", (d,)),
            (f"h.{i}.ln_1.bias", (d,)),
            (f"h.{i}.attn.c_attn.weight", (d, 3 * d)),
            (f"h.{i}.attn.c_attn.bias", (3 * d,)),
            (f"h.{i}.attn.c_proj.weight", (d, d)),
            (f"h.{i}.attn.c_proj.bias", (d,)),
            (f"h.{i}.ln_2.weight", (d,)),
            (f"h.{i}.ln_2.bias", (d,)),
            (f"h.{i}.mlp.c_fc.weight", (d, 4 * d)),
            (f"h.{i}.mlp.c_fc.bias", (4 * d,)),
            (f"h.{i}.mlp.c_proj.weight", (4 * d, d)),
            (f"h.{i}.mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    ran = f"{kept}/{layers} layers, {rows}/{vocab} vocabulary rows, d={d}"
    return LayerSet("gpt2-small", tuple(shapes), ran)


def llama_layer(scale: float = 1.0, *, d: int = 4096, ffn: int = 11008) -> LayerSet:
    """One Llama-7B decoder layer and the token embedding (no biases)."""
    vocab = 32000
    rows = _kept(vocab, scale)
    layer = "layers.0"
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (rows, d))]
    shapes += [(f"{layer}.self_attn.{p}_proj.weight", (d, d)) for p in "qkvo"]
    shapes += [
        (f"{layer}.mlp.gate_proj.weight", (ffn, d)),
        (f"{layer}.mlp.up_proj.weight", (ffn, d)),
        (f"{layer}.mlp.down_proj.weight", (d, ffn)),
        (f"{layer}.input_layernorm.weight", (d,)),
        (f"{layer}.post_attention_layernorm.weight", (d,)),
    ]
    ran = f"1 layer, {rows}/{vocab} embedding rows, d={d}, ffn={ffn}"
    return LayerSet("llama-7b layer", tuple(shapes), ran)


def vit_b16(scale: float = 1.0, *, d: int = 768, layers: int = 12) -> LayerSet:
    """ViT-B/16 at 224 px, 1000 classes (torchvision's parameter names)."""
    patch, image, classes, mlp = 16, 224, 1000, 4 * d
    kept = _kept(layers, scale)
    tokens = (image // patch) ** 2 + 1
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("class_token", (1, 1, d)),
        ("conv_proj.weight", (d, 3, patch, patch)),
        ("conv_proj.bias", (d,)),
        ("encoder.pos_embedding", (1, tokens, d)),
    ]
    for i in range(kept):
        block = f"encoder.layers.encoder_layer_{i}"
        shapes += [
            (f"{block}.ln_1.weight", (d,)),
            (f"{block}.ln_1.bias", (d,)),
            (f"{block}.self_attention.in_proj_weight", (3 * d, d)),
            (f"{block}.self_attention.in_proj_bias", (3 * d,)),
            (f"{block}.self_attention.out_proj.weight", (d, d)),
            (f"{block}.self_attention.out_proj.bias", (d,)),
            (f"{block}.ln_2.weight", (d,)),
            (f"{block}.ln_2.bias", (d,)),
            (f"{block}.mlp.0.weight", (mlp, d)),
            (f"{block}.mlp.0.bias", (mlp,)),
            (f"{block}.mlp.3.weight", (d, mlp)),
            (f"{block}.mlp.3.bias", (d,)),
        ]
    shapes += [
        ("encoder.ln.weight", (d,)),
        ("encoder.ln.bias", (d,)),
        ("heads.head.weight", (classes, d)),
        ("heads.head.bias", (classes,)),
    ]
    return LayerSet("vit-b/16", tuple(shapes), f"{kept}/{layers} layers, d={d}")


def layer_sets(scale: float, *, quick: bool) -> list[LayerSet]:
    """The three sets; ``quick``: their structure at d = 16 and one layer (the smoke test)."""
    if quick:
        return [
            gpt2_small(0.002, d=16, layers=1),
            llama_layer(0.002, d=16, ffn=40),
            vit_b16(1.0, d=16, layers=1),
        ]
    return [gpt2_small(scale), llama_layer(scale), vit_b16(scale)]


class ShapeModel(nn.Module):
    """A module whose trainable parameters have the set's shapes (dots in names become '_').

    ``real``: parameters of their own; otherwise a zero expanded to the shape, one element of
    memory each (the buffered mode reads gradients, never a parameter's ``.data``)."""

    def __init__(self, layer_set: LayerSet, *, real: bool, device: torch.device = CPU) -> None:
        super().__init__()
        self.weights = nn.ParameterDict()
        for name, shape in layer_set.shapes:
            data = (
                torch.zeros(shape, device=device)
                if real
                else torch.zeros(1, device=device).expand(shape)
            )
            self.weights[name.replace(".", "_")] = nn.Parameter(data)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Random gradients on the model's device (drawn on the CPU: the same values everywhere)."""
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(p.shape, generator=generator).to(p.device)
        for name, p in model.named_parameters()
    }


def _row(
    case: str,
    mode: str,
    value: float,
    floor_value: float,
    *,
    floor: str,
    unit: str = "ms",
    target: float | None = None,
    device: torch.device = CPU,
) -> Row:
    scale = 1e3 if unit == "ms" else 1 / MIB
    return Row(
        suite=SUITE,
        case=case,
        mode=mode,
        dtype="float32",
        device=str(device),
        value=value * scale,
        unit=unit,
        ratio=None if mode == floor else ratio(value, floor_value),
        floor="" if mode == floor else floor,
        target=None if mode == floor else target,
    )


def _rows(
    case: str, medians: dict[str, float], floor: str, device: torch.device = CPU
) -> list[Row]:
    return [
        _row(
            case,
            mode,
            seconds,
            medians[floor],
            floor=floor,
            target=TARGETS.get(mode),
            device=device,
        )  # fmt: skip
        for mode, seconds in medians.items()
    ]


def _accumulate_rows(layer_set: LayerSet, repeats: int, device: torch.device = CPU) -> list[Row]:
    """The buffered calls against the floor, in two interleaved groups (memory: at most the
    gradients and four sets of buffers exist at once)."""
    model = ShapeModel(layer_set, real=False, device=device)
    grads = _gradients(model)
    grad_list = list(grads.values())
    parameters = [p for _, p in model.named_parameters()]
    bufs = [torch.zeros_like(g) for g in grad_list]

    def accumulator(fused: bool = False) -> WeightedGradientsAccumulator:
        return WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=fused)

    floor = Timed(lambda: torch._foreach_add_(bufs, grad_list, alpha=WEIGHT))
    accs = {"sum": accumulator(), "mean": accumulator(), "fused": accumulator(fused=True)}
    first: dict[str, Timed] = {
        FLOOR: floor,
        "accumulate_sum (grads=)": Timed(
            lambda: accs["sum"].accumulate_sum(model, WEIGHT, grads=grads)
        ),
        "accumulate_mean (grads=)": Timed(
            lambda: accs["mean"].accumulate_mean(model, WEIGHT, grads=grads)
        ),
        "accumulate_mean fused (grads=)": Timed(
            lambda: accs["fused"].accumulate_mean(model, WEIGHT, grads=grads)
        ),
    }
    medians = interleaved_medians(first, device=device, repeats=repeats)
    rows = _rows(layer_set.case, medians, FLOOR, device)
    accs.clear()  # their buffers go before the second group's are made

    def set_grads() -> None:
        for parameter, grad in zip(parameters, grad_list, strict=True):
            parameter.grad = grad.clone()

    taking, taking_sum, finishing = accumulator(), accumulator(), accumulator()
    disposing = accumulator()
    incoming: list[torch.Tensor] = []  # autograd's gradient of a microbatch, before it is added

    def arrive() -> None:
        incoming[:] = [grad.clone() for grad in grad_list]

    def accumulate_grad() -> None:
        # The plain loop's AccumulateGrad on a later microbatch: .grad += the incoming gradient,
        # which is then released (the .grad rows take it instead of adding it, and free it too).
        torch._foreach_add_(bufs, incoming)
        incoming.clear()

    second: dict[str, Timed] = {
        FLOOR: floor,
        PLAIN_ADD: Timed(accumulate_grad, setup=arrive),
        # The sum takes .grad too: its ratio is what taking (and freeing) the gradients costs,
        # so the mean's minus it is the product's own cost.
        "accumulate_sum (.grad)": Timed(
            lambda: taking_sum.accumulate_sum(model, WEIGHT), setup=set_grads
        ),
        "accumulate_mean (.grad)": Timed(
            lambda: taking.accumulate_mean(model, WEIGHT), setup=set_grads
        ),
        # The same, the product written into each .grad it takes (no work piece).
        "accumulate_mean (.grad, disposable)": Timed(
            lambda: disposing.accumulate_mean(model, WEIGHT, disposable=True), setup=set_grads
        ),
        "finish_mean": Timed(
            finishing.finish_mean,
            setup=lambda: finishing.accumulate_mean(model, WEIGHT, grads=grads),
        ),
    }
    taken = interleaved_medians(second, device=device, repeats=repeats)
    rows += [row for row in _rows(layer_set.case, taken, FLOOR, device) if row.mode != FLOOR]
    if device.type == "cuda":
        case = f"{layer_set.case}: GB/s"
        rows += bandwidth_rows(SUITE, case, device, bufs, {**taken, **medians}, TRAFFIC, repeats)
    return rows


# Bytes a call must move, in whole passes over the gradients (read the buffer and the gradient,
# write the buffer; a product written into the gradient also writes it; finish_mean reads and
# writes the buffers), for the GB/s rows (CUDA: benchmarks.bandwidth).
TRAFFIC = {
    FLOOR: 3,
    "accumulate_sum (grads=)": 3,
    "accumulate_mean (grads=)": 3,
    "accumulate_mean fused (grads=)": 3,
    "accumulate_sum (.grad)": 3,
    "accumulate_mean (.grad)": 3,
    "accumulate_mean (.grad, disposable)": 4,
    PLAIN_ADD: 3,
    "finish_mean": 2,
}


def _roots(model: nn.Module) -> list[torch.Tensor]:
    """Tensors whose backward hands each parameter a gradient autograd made (``p * 1.0``)."""
    with torch.enable_grad():
        return [p * 1.0 for p in model.parameters()]


def _backward(model: nn.Module, seeds: list[torch.Tensor]) -> Timed:
    roots: list[torch.Tensor] = []

    def build() -> None:
        roots[:] = _roots(model)

    def call() -> None:
        torch.autograd.backward(roots, grad_tensors=seeds)
        roots.clear()

    return Timed(call, setup=build)


def _in_block(
    accumulator: WeightedGradientsAccumulator, model: nn.Module, kind: str, backward: Timed
) -> Timed:
    def call() -> None:
        with accumulator.microbatch(model, weight=WEIGHT, kind=kind):  # type: ignore[arg-type]
            backward.call()

    return Timed(call, setup=backward.setup)


def _zero_copy_rows(layer_set: LayerSet, repeats: int, device: torch.device = CPU) -> list[Row]:
    """Zero-copy blocks against the plain backward, each on a model of its own."""
    plain = ShapeModel(layer_set, real=False, device=device)
    seeds = list(_gradients(plain).values())
    modes: dict[str, Timed] = {PLAIN: _backward(plain, seeds)}
    for kind in ("mean", "sum"):
        model = ShapeModel(layer_set, real=False, device=device)
        accumulator = WeightedGradientsAccumulator(
            dtype=torch.float32, loss_scale=1.0, zero_copy=True
        )
        modes[f"zero-copy block ({kind})"] = _in_block(
            accumulator, model, kind, _backward(model, seeds)
        )
    medians = interleaved_medians(modes, device=device, repeats=repeats)
    return _rows(f"{layer_set.case}: backward", medians, PLAIN, device)


def _window_peak(layer_set: LayerSet, mode: str, device: torch.device = CPU) -> int:
    """Peak gradient memory of a window of two microbatches (two backward passes) in ``mode``:
    ``plain``, ``wacc-buffered mean`` (``accumulate_mean`` of the ``.grad`` it takes) or
    ``wacc-zero-copy mean|sum`` (a ``microbatch`` block around each backward)."""
    model = ShapeModel(layer_set, real=False, device=device)
    seeds = list(_gradients(model).values())
    parameters = list(model.parameters())
    zero_copy = mode.startswith("wacc-zero-copy")
    accumulator = None
    if mode != "plain":
        accumulator = WeightedGradientsAccumulator(
            dtype=torch.float32, loss_scale=1.0, zero_copy=zero_copy
        )
    log = StorageLog()

    def sample() -> None:
        pending: list[torch.Tensor | None] = []
        if accumulator is not None:
            pending += pending_buffers(accumulator).values()
        log.mark([p.grad for p in parameters] + pending)

    with log:
        for _ in range(2):
            roots = _roots(model)
            if accumulator is not None and zero_copy:
                kind = mode.rsplit(" ", 1)[1]
                with accumulator.microbatch(model, weight=WEIGHT, kind=kind):  # type: ignore[arg-type]
                    torch.autograd.backward(roots, grad_tensors=seeds)
            else:
                torch.autograd.backward(roots, grad_tensors=seeds)
                sample()
                if accumulator is not None:
                    accumulator.accumulate_mean(model, WEIGHT)
            del roots
            sample()
    return log.peak(gradient_only=True)


def _memory_rows(layer_set: LayerSet, device: torch.device = CPU) -> list[Row]:
    """Peak gradient memory per mode (one model at a time)."""
    modes = ("plain", "wacc-buffered mean", "wacc-zero-copy mean", "wacc-zero-copy sum")
    peaks = {mode: _window_peak(layer_set, mode, device) for mode in modes}
    return [
        _row(
            f"{layer_set.case}: peak gradient memory",
            mode,
            peak,
            peaks["plain"],
            floor="plain",
            unit="MiB",
            target=MEMORY_TARGETS.get(mode),
            device=device,
        )
        for mode, peak in peaks.items()
    ]


def _with_piece(elements: int, call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with the pieces of a two-rounding step set to ``elements`` elements."""

    def timed() -> object:
        kept = _work.CHUNK_ELEMENTS
        _work.CHUNK_ELEMENTS = elements
        try:
            return call()
        finally:
            _work.CHUNK_ELEMENTS = kept

    return timed


def _piece_rows(repeats: int, *, quick: bool, device: torch.device = CPU) -> list[Row]:
    """The piece size of a reproducible mean: ``accumulate_mean`` on one 4096 x 4096 matrix (a
    Llama-7B projection) with pieces of 2**14 to 2**24 elements (the whole matrix), with
    ``grads=`` and on the ``.grad`` it takes (and drops), beside the floor."""
    rows_, columns = (64, 64) if quick else (4096, 4096)
    layer_set = LayerSet("piece size", (("w", (rows_, columns)),), f"{rows_} x {columns}")
    model = ShapeModel(layer_set, real=False, device=device)
    grads = _gradients(model)
    grad_list = list(grads.values())
    bufs = [torch.zeros_like(g) for g in grad_list]
    parameter = next(model.parameters())
    modes: dict[str, Timed] = {
        FLOOR: Timed(lambda: torch._foreach_add_(bufs, grad_list, alpha=WEIGHT))
    }
    for exponent in (10, 12) if quick else (14, 16, 18, 20, 22, 24):
        accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        call = partial(accumulator.accumulate_mean, model, WEIGHT, grads=grads)
        modes[f"accumulate_mean (grads=), pieces of 2**{exponent}"] = Timed(
            _with_piece(2**exponent, call)
        )

    def set_grad() -> None:
        parameter.grad = grad_list[0].clone()

    for exponent in (10, 12) if quick else (18, 20, 22, 24):
        taking = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        call = partial(taking.accumulate_mean, model, WEIGHT)
        modes[f"accumulate_mean (.grad), pieces of 2**{exponent}"] = Timed(
            _with_piece(2**exponent, call), setup=set_grad
        )
    medians = interleaved_medians(modes, device=device, repeats=repeats)
    return [
        _row(layer_set.case, mode, seconds, medians[FLOOR], floor=FLOOR, device=device)
        for mode, seconds in medians.items()
    ]


def _set_rows(layer_set: LayerSet, repeats: int, device: torch.device) -> list[Row]:
    """Every row of one layer set: accumulate, zero-copy and memory."""
    return [
        *_accumulate_rows(layer_set, repeats, device),
        *_zero_copy_rows(layer_set, repeats, device),
        *_memory_rows(layer_set, device),
    ]


def in_fresh_process(call: Callable[..., list[Row]], *args: object) -> list[Row]:
    """``call(*args)`` in a new interpreter (spawned): a layer set of a gigabyte leaves the
    process's allocator in a state that slowed the next set's means by 6-10 % in one process
    (ViT-B/16 after the Llama layer: 1.41-1.46x the floor, 1.33x alone)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(call, *args).result()


def run(settings: Settings) -> list[Row]:
    """Each layer set, and the piece sizes, in a process of its own (``--quick``: in this one).
    11 samples per mode: with 7, a 25-35 ms floor's ratios moved by up to 6 % between runs."""
    repeats = settings.repeats_or(11)
    isolate = _in_this_process if settings.quick else in_fresh_process
    rows: list[Row] = []
    for device in settings.devices:
        for layer_set in layer_sets(settings.shape_scale, quick=settings.quick):
            rows += isolate(_set_rows, layer_set, repeats, device)
        rows += isolate(_piece_rows_of, repeats, settings.quick, device)
    return rows


def _in_this_process(call: Callable[..., list[Row]], *args: object) -> list[Row]:
    return call(*args)


def _piece_rows_of(repeats: int, quick: bool, device: torch.device) -> list[Row]:
    return _piece_rows(repeats, quick=quick, device=device)
