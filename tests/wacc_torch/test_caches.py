"""The cached checks accept exactly what the full checks accept (issue 15, "the rule, by
construction"): the module-structure snapshot of ``wacc_torch._binding.Binder`` against
``check_bound``, and the gradient-signature cache of ``wacc_torch._gradients.GradientCheck``
against ``check_gradients``, on random modules, random mutations of them and random gradient
sets. Each property warms the cache on a valid input first, so the cached path is the one taken
whenever the snapshot or signature still matches.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn

from wacc_torch._binding import Binder, binding_of, check_bound, tracked_parameters
from wacc_torch._gradients import GradientCheck, check_gradients
from wacc_torch._work import Scratch
from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.buffered import BufferedMode
from wacc_torch.errors import ParameterMismatchError

SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def _module(shapes: list[tuple[int, ...]], nested: bool) -> nn.Module:
    root = nn.Module()
    holder = root
    if nested:
        holder = nn.Module()
        root.inner = holder
    for index, shape in enumerate(shapes):
        setattr(holder if index % 2 else root, f"p{index}", nn.Parameter(torch.zeros(shape)))
    return root


def _parameter(module: nn.Module, index: int) -> tuple[nn.Module, str]:
    """The submodule holding parameter ``index`` (by registration order) and its local name;
    a fresh one on the root when every parameter was deleted."""
    names = [name for name, _ in module.named_parameters()]
    if not names:
        module.fresh = nn.Parameter(torch.zeros(1))
        names = ["fresh"]
    path = names[index % len(names)].split(".")
    owner = module.get_submodule(".".join(path[:-1]))
    return owner, path[-1]


Mutation = Callable[[nn.Module], None]


def _reshape(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        p = getattr(owner, name)
        p.data = p.data.reshape(1, *p.shape)  # same elements, another shape

    return mutate


def _resize(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        p = getattr(owner, name)
        p.data = torch.zeros(p.numel() + 1)

    return mutate


def _retype(index: int, dtype: torch.dtype) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        p = getattr(owner, name)
        if p.requires_grad and not dtype.is_floating_point:
            return  # torch itself refuses it (a trainable .data must be floating): no such change
        p.data = p.data.to(dtype)

    return mutate


def _freeze(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        p = getattr(owner, name)
        p.requires_grad_(not p.requires_grad)

    return mutate


def _replace(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        setattr(owner, name, nn.Parameter(torch.zeros(getattr(owner, name).shape)))

    return mutate


def _delete(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, name = _parameter(module, index)
        delattr(owner, name)

    return mutate


def _add(module: nn.Module) -> None:
    module.extra = nn.Parameter(torch.zeros(2))


def _new_dict(index: int) -> Mutation:
    def mutate(module: nn.Module) -> None:
        owner, _ = _parameter(module, index)
        owner._parameters = dict(owner._parameters)  # the same parameters in a new dict

    return mutate


def _swap_inner(module: nn.Module) -> None:
    if "inner" in module._modules:
        inner = module.inner
        fresh = nn.Module()
        for name, p in inner.named_parameters(recurse=False):
            fresh.register_parameter(name, nn.Parameter(p.detach().clone()))
        module.inner = fresh


def _nothing(module: nn.Module) -> None:
    return None


def mutations() -> st.SearchStrategy[Mutation]:
    index = st.integers(0, 5)
    return st.one_of(
        index.map(_reshape),
        index.map(_resize),
        st.builds(_retype, index, st.sampled_from([torch.float64, torch.float16, torch.int64])),
        index.map(_freeze),
        index.map(_replace),
        index.map(_delete),
        index.map(_new_dict),
        st.just(_add),
        st.just(_swap_inner),
        st.just(_nothing),
    )


def _outcome(check: Callable[[], object]) -> tuple[str, object]:
    try:
        result = check()
    except ParameterMismatchError as error:
        return "ParameterMismatchError", str(error)
    assert isinstance(result, list)
    return "accepted", [(name, id(p)) for name, p in result]


@given(
    shapes=st.lists(SHAPES, min_size=1, max_size=5),
    nested=st.booleans(),
    changes=st.lists(mutations(), max_size=3),
)
def test_the_structure_snapshot_accepts_exactly_what_the_full_check_accepts(
    shapes: list[tuple[int, ...]], nested: bool, changes: list[Mutation]
) -> None:
    """After any mutations of a bound module (reshaped, resized or re-typed .data, frozen,
    replaced, deleted or added parameters, a replaced parameter dict or submodule), the binder's
    cached check mid-window gives the full check's answer: the same parameters, or the same
    ParameterMismatchError (neither reads .data: semantics §3 Reading)."""
    module = _module(shapes, nested)
    binder = Binder()
    binding, _ = binder.check(module, None, issued=0)
    binder.check(module, binding, issued=1)  # the snapshot is now warm
    for change in changes:
        change(module)
        note(f"after {change.__qualname__}")
        cached = _outcome(lambda: binder.check(module, binding, issued=1)[1])
        full = _outcome(lambda: check_bound(module, binding, issued=1))
        assert cached == full


@dataclass(frozen=True)
class _TensorLike:
    """A tensor's shape, dtype, device and layout, but no tensor."""

    shape: torch.Size
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    layout: torch.layout = torch.strided


def _candidate(kind: str, shape: torch.Size) -> object:
    if kind == "same":
        return torch.ones(shape)
    if kind == "other-shape":
        return torch.ones(shape.numel() + 1)
    if kind == "flat":
        return torch.ones(shape.numel())
    if kind == "float64":
        return torch.ones(shape, dtype=torch.float64)
    if kind == "int":
        return torch.ones(shape, dtype=torch.int32)
    if kind == "complex":
        return torch.ones(shape, dtype=torch.complex64)
    if kind == "sparse":
        return torch.ones(shape).to_sparse()
    if kind == "transposed":
        return torch.ones(tuple(reversed(shape))).t() if len(shape) == 2 else torch.ones(shape)
    if kind == "parameter":
        return nn.Parameter(torch.ones(shape))
    if kind == "tensor-like":
        return _TensorLike(shape)
    if kind == "none":
        return None
    if kind == "text":
        return "gradient"
    raise AssertionError(kind)


KINDS = [
    "same",
    "other-shape",
    "flat",
    "float64",
    "int",
    "complex",
    "sparse",
    "transposed",
    "parameter",
    "tensor-like",
    "none",
    "text",
]


@given(
    shapes=st.lists(SHAPES, min_size=1, max_size=4),
    warm=st.lists(st.sampled_from(["same", "float64", "transposed", "parameter"]), max_size=4),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
)
def test_the_gradient_signature_cache_accepts_exactly_what_the_full_check_accepts(
    shapes: list[tuple[int, ...]], warm: list[str], kinds: list[str]
) -> None:
    """After a complete, valid gradient set warmed the cache, any set (other shapes, dtypes,
    layouts, a tensor subclass, a non-tensor with tensor attributes, None, text) gets the full
    check's answer from GradientCheck.collect: the same gradients, or the same
    ParameterMismatchError."""
    module = _module(shapes, nested=False)
    parameters = tracked_parameters(module)
    binding = binding_of(parameters)
    check = GradientCheck()

    def candidates(chosen: list[str]) -> dict[str, object]:
        return {
            name: _candidate(chosen[i % len(chosen)] if chosen else "same", p.shape)
            for i, (name, p) in enumerate(parameters)
        }

    check.collect(binding, parameters, candidates(warm))  # type: ignore[arg-type]
    grads = candidates(kinds)
    note(f"gradients: {[type(g).__name__ for g in grads.values()]}")

    def full() -> object:
        listed = [grads.get(name) for name in binding.names]
        check_gradients(binding, listed)  # type: ignore[arg-type]
        return listed

    def cached() -> object:
        return check.collect(binding, parameters, grads)  # type: ignore[arg-type]

    def outcome(call: Callable[[], object]) -> tuple[str, object]:
        try:
            result = call()
        except ParameterMismatchError as error:
            return "ParameterMismatchError", str(error)
        assert isinstance(result, list)
        return "accepted", [id(g) for g in result]

    assert outcome(cached) == outcome(full)


def test_the_properties_can_fail() -> None:
    """The structure property notices a snapshot that ignores a parameter's requires_grad: a
    parameter frozen mid-window is then accepted by the cache and refused by the full check."""
    import wacc_torch._structure as structure

    module = _module([(4,), (3,)], nested=False)
    binder = Binder()
    binding, _ = binder.check(module, None, issued=0)
    original = structure._REQUIRES_GRAD
    try:
        structure._REQUIRES_GRAD = lambda p: True  # type: ignore[assignment]
        binder.check(module, binding, issued=1)
        _freeze(0)(module)
        cached = _outcome(lambda: binder.check(module, binding, issued=1)[1])
    finally:
        structure._REQUIRES_GRAD = original
    full = _outcome(lambda: check_bound(module, binding, issued=1))
    assert cached[0] == "accepted" and full[0] == "ParameterMismatchError"


@pytest.mark.parametrize("kind", ["tensor-like", "text"])
def test_a_non_tensor_never_enters_the_signature_cache(kind: str) -> None:
    """A set holding a non-tensor is refused by the full check and leaves the cache as it was:
    the next valid set is still accepted, the same non-tensor still refused."""
    module = _module([(3,), (2,)], nested=False)
    parameters = tracked_parameters(module)
    binding = binding_of(parameters)
    check = GradientCheck()
    valid = {name: torch.ones(p.shape) for name, p in parameters}
    check.collect(binding, parameters, valid)
    bad = dict(valid, p1=_candidate(kind, parameters[1][1].shape))
    for _ in range(2):
        with pytest.raises(ParameterMismatchError, match="must be a tensor or None"):
            check.collect(binding, parameters, bad)  # type: ignore[arg-type]
    assert check.collect(binding, parameters, valid) == list(valid.values())


@given(
    shapes=st.lists(SHAPES, min_size=1, max_size=5),
    nested=st.booleans(),
    changes=st.lists(mutations(), max_size=3),
)
def test_current_answers_as_the_full_check_and_only_for_the_binding_it_checked(
    shapes: list[tuple[int, ...]], nested: bool, changes: list[Mutation]
) -> None:
    """Binder.current(binding) gives the full check's parameters for the last module checked
    with that binding (after any mutations: the same parameters, or None where check_bound
    raises), and None for a binding it did not check or when nothing is cached (a fresh binder,
    or after forget)."""
    module = _module(shapes, nested)
    binder = Binder()
    binding, _ = binder.check(module, None, issued=0)
    assert Binder().current(binding) is None
    other = binding_of(tracked_parameters(_module([(7,)], nested=False)))
    for change in changes:
        change(module)
        note(f"after {change.__qualname__}")
        full = _outcome(lambda: check_bound(module, binding, issued=1))
        current = binder.current(binding)
        if current is None:
            assert full[0] == "ParameterMismatchError"
        else:
            assert full == ("accepted", [(name, id(p)) for name, p in current])
        assert binder.current(other) is None
    assert binder.current(other) is None
    binder.forget()
    assert binder.current(binding) is None


def test_a_mid_window_change_of_several_kinds_names_each_in_its_own_clause() -> None:
    """A parameter frozen and another one added in the same window: check_bound's
    ParameterMismatchError names both, each kind of change in its own clause ("; "-separated,
    the names right after their kind)."""
    module = _module([(4,), (3,)], nested=False)
    binding = binding_of(tracked_parameters(module))
    _freeze(0)(module)
    _add(module)
    with pytest.raises(ParameterMismatchError) as raised:
        check_bound(module, binding, issued=2)
    message = str(raised.value)
    assert "issued=2" in message
    assert re.search(
        r"frozen \(requires_grad=False\)[^;\[]*: \['p0'\]; trainable but not tracked[^;\[]*: "
        r"\['extra'\]\.",
        message,
    ), message


def test_a_scratch_view_is_made_once_per_shape_and_reused() -> None:
    """Scratch.view hands out one view per (device, dtype, shape), made on first use and the
    same tensor object on every later call; views of other shapes start at the same place of
    that (device, dtype)'s work tensor."""
    cpu = torch.device("cpu")
    scratch = Scratch([(cpu, torch.float32, 12), (cpu, torch.bfloat16, 6)])
    first = scratch.view(cpu, torch.float32, torch.Size([3, 4]))
    assert first.shape == (3, 4) and first.dtype == torch.float32
    assert scratch.view(cpu, torch.float32, torch.Size([3, 4])) is first
    other = scratch.view(cpu, torch.float32, torch.Size([5]))
    assert other is not first and other.data_ptr() == first.data_ptr()
    assert scratch.view(cpu, torch.float32, torch.Size([3, 4])) is first
    half = scratch.view(cpu, torch.bfloat16, torch.Size([2, 3]))
    assert half.shape == (2, 3) and half.dtype == torch.bfloat16
    assert scratch.view(cpu, torch.bfloat16, torch.Size([2, 3])) is half


def test_work_tensors_exist_only_for_two_rounding_steps_and_are_kept_on_the_cpu() -> None:
    """The buffered mode prepares a work tensor only for a step that rounds twice (a gradient of
    another dtype converted first, or the non-fused mean's product round_D(c * w_D) of a gradient
    the accumulator does not own, here a large one handed in by grads=): a sum of gradients
    already in D and a fused mean of them need none. A CPU work tensor is kept and reused by the
    next call it is large enough for (the kept_work memory cache)."""
    module = _module([(3,), (4,), (130, 130)], nested=False)
    in_d = {name: torch.ones(p.shape) for name, p in module.named_parameters()}
    other = {name: grad.to(torch.bfloat16) for name, grad in in_d.items()}
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    mode = accumulator._mode
    assert isinstance(mode, BufferedMode)
    accumulator.accumulate_sum(module, 1, grads=in_d)
    assert mode.kept_work is not None and mode.kept_work._storage == {}
    accumulator.accumulate_mean(module, 3, grads=in_d)
    work = mode.kept_work
    assert work is not None and list(work._storage) == [(torch.device("cpu"), torch.float32)]
    accumulator.accumulate_sum(module, 1, grads=other)  # a conversion: fits the kept one
    assert mode.kept_work is work
    fused = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=True)
    fused.accumulate_mean(module, 3, grads=in_d)
    assert isinstance(fused._mode, BufferedMode)
    kept = fused._mode.kept_work
    assert kept is not None and kept._storage == {}


def test_check_gradients_needs_exactly_one_gradient_per_tracked_parameter() -> None:
    """check_gradients pairs the gradients with the tracked parameters one to one: a list shorter
    or longer than the binding is refused (ValueError), never checked in part."""
    parameters = tracked_parameters(_module([(3,), (2,)], nested=False))
    binding = binding_of(parameters)
    check_gradients(binding, [torch.ones(3), torch.ones(2)])  # one per parameter: accepted
    for wrong in ([torch.ones(3)], [torch.ones(3), torch.ones(2), torch.ones(4)]):
        with pytest.raises(ValueError, match="zip"):
            check_gradients(binding, wrong)  # type: ignore[arg-type]


def test_a_repeated_signature_skips_the_full_check_for_its_own_binding_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GradientCheck checks a complete set in full once; a later complete set of the same
    signature for the same binding is accepted without a full check (and common_dtype answers
    from that signature, not from the tensors). A set with a None, another signature, or another
    binding (even one whose signature would match) gets the full check; so a gradient of the
    first binding's shape is refused for a binding tracking another shape."""
    import wacc_torch._gradients as gradients

    full_checks: list[int] = []

    def counted(binding: object, candidates: list[torch.Tensor | None]) -> None:
        full_checks.append(len(candidates))
        check_gradients(binding, candidates)  # type: ignore[arg-type]

    monkeypatch.setattr(gradients, "check_gradients", counted)
    parameters = tracked_parameters(_module([(3,), (2,)], nested=False))
    binding = binding_of(parameters)
    check = GradientCheck()

    def fresh() -> dict[str, torch.Tensor | None]:
        return {name: torch.ones(p.shape) for name, p in parameters}

    check.collect(binding, parameters, fresh())
    assert len(full_checks) == 1
    grads = fresh()
    assert check.collect(binding, parameters, grads) == list(grads.values())
    assert len(full_checks) == 1  # same signature, same binding: from the cache
    # Read from the signature: the gradients handed in are not looked at.
    assert check.common_dtype((0, 1), [None, None]) == torch.float32
    check.collect(binding, parameters, dict(fresh(), p1=None))  # incomplete: in full
    assert len(full_checks) == 2
    check.collect(binding, parameters, fresh())  # the cached signature still holds
    assert len(full_checks) == 2
    check.collect(binding, parameters, dict(fresh(), p1=torch.ones(2, dtype=torch.float64)))
    assert len(full_checks) == 3  # another signature: in full (and now cached)
    check.collect(binding, parameters, fresh())
    assert len(full_checks) == 4
    twin = binding_of(tracked_parameters(_module([(3,), (2,)], nested=False)))
    check.collect(twin, parameters, fresh())  # another binding: in full
    assert len(full_checks) == 5
    other_parameters = tracked_parameters(_module([(4,), (2,)], nested=False))
    other = binding_of(other_parameters)
    with pytest.raises(ParameterMismatchError, match=r"'p0'.*\[3\].*\[4\]"):
        check.collect(other, other_parameters, fresh())


def test_a_kept_scratch_is_reused_only_on_the_cpu_and_only_when_it_holds_every_need() -> None:
    """Scratch.reusing returns the previous Scratch when it lives on the CPU and holds, for every
    (device, dtype) needed, a work tensor at least as large as the need (equal included); a need
    for a (device, dtype) it holds nothing for, however small (one element or none), or a larger
    one, or any need off the CPU gets a new Scratch that can hand out the view."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    kept = Scratch([(cpu, torch.float32, 6)])
    assert Scratch.reusing(kept, [(cpu, torch.float32, 6)]) is kept
    assert Scratch.reusing(kept, [(cpu, torch.float32, 2), (cpu, torch.float32, 5)]) is kept
    assert Scratch.reusing(kept, []) is kept
    for need in [(cpu, torch.float32, 7), (cpu, torch.float64, 1), (cpu, torch.float64, 0)]:
        new = Scratch.reusing(kept, [need])
        assert new is not kept
        assert new.view(need[0], need[1], torch.Size([need[2]])).shape == (need[2],)
    empty = Scratch([])
    one = Scratch.reusing(empty, [(cpu, torch.float32, 1)])
    assert one is not empty and one.view(cpu, torch.float32, torch.Size([1])).numel() == 1
    on_meta = Scratch([(meta, torch.float32, 6)])
    assert Scratch.reusing(on_meta, [(meta, torch.float32, 6)]) is not on_meta


def test_every_call_of_a_window_adds_the_small_gradients_into_the_one_arena() -> None:
    """Within a window the small parameters' buffers stay views of one arena per device, made at
    the first positive call and used by every later call (so the division divides it as one
    tensor, and the sums are those of the per-tensor adds); a new window makes a new one."""
    module = _module([(3,), (4,), (2, 5)], nested=False)
    grads = {name: torch.ones(p.shape) for name, p in module.named_parameters()}
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    mode = accumulator._mode
    assert isinstance(mode, BufferedMode)
    cpu = torch.device("cpu")
    accumulator.accumulate_sum(module, 1, grads=grads)
    arena = mode.arenas[cpu]
    for _ in range(3):
        accumulator.accumulate_sum(module, 2, grads=grads)
        assert list(mode.arenas) == [cpu] and mode.arenas[cpu] is arena
        assert f"<arena {cpu}>" in mode.division_targets()
    sums = accumulator.finish_sums().grads
    for name, p in module.named_parameters():
        assert torch.equal(sums[name], torch.full(p.shape, 4.0))  # four gradients of ones
    accumulator.accumulate_sum(module, 1, grads=grads)
    assert mode.arenas[cpu] is not arena
