"""OLMo-core's ``TransformerTrainModule.train_batch`` (:mod:`wacc.audit.adapters.olmo_core`): the
window's sequences as one ``[K, L]`` batch (labels shifted as ``get_labels`` shifts them), the
model behind a wrapper with an OLMo-core ``Transformer``'s loss forward (its
``cross_entropy_loss``, ``reduction="sum"``, then ``LMHead._finalize_loss``: ``/
loss_div_factor``), ``train_batch(dry_run=True)`` on a train module whose ``__init__`` is replaced
by these objects, then the optimizer step.  ``BODY``: one process.  ``RANKS``: across the torchrun
world, as the adapter runs it: ``init_distributed(backend="gloo")``, ``build_world_mesh`` for
FSDP, ``Transformer.apply_fsdp`` on the wrapper (the root alone sharded; the reduction in the
run's dtype) and ``train_batch``'s FSDP micro-batch context; the gradient each rank holds a shard
of is gathered whole (``full_tensor()``) in the optimizer's step pre-hook."""

from __future__ import annotations

__all__ = ["BODY", "IMPORTS", "RANKS", "RANKS_IMPORTS"]

IMPORTS = (
    "import types",
    "from olmo_core.nn.functional import cross_entropy_loss",
    "from olmo_core.nn.lm_head import LMHead, LMOutputWithLoss",
    "from olmo_core.train.train_module import TransformerDataParallelConfig",
    "from olmo_core.train.train_module import TransformerTrainModule",
)
RANKS_IMPORTS = (
    *IMPORTS,
    "from olmo_core.distributed.parallel import DataParallelType, build_world_mesh",
    "from olmo_core.distributed.parallel import get_dp_model_mesh",
    "from olmo_core.distributed.utils import init_distributed",
    "from olmo_core.nn.transformer import Transformer",
)

_WRAPPER = '''
class OLMoTransformer(torch.nn.Module):
    """The model with an OLMo-core Transformer's training forward: LMHead's loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.divisors = []

    def forward(self, input_ids, labels, *, ignore_index, loss_reduction, z_loss_multiplier,
                loss_div_factor, return_logits=None):
        logits = self.model(input_ids=input_ids)["logits"]
        ce_loss, _ = cross_entropy_loss(
            logits.view(-1, logits.shape[-1]), labels.contiguous().view(-1),
            ignore_index=ignore_index, reduction=loss_reduction,
            compute_z_loss=z_loss_multiplier is not None,
            z_loss_multiplier=z_loss_multiplier or 1e-4,
        )
        self.divisors.append(int(loss_div_factor))
        head = types.SimpleNamespace(tp_enabled=False, cp_enabled=False)

        def finalize(loss):  # LMHead: / loss_div_factor
            return LMHead._finalize_loss(head, loss, input_ids.shape[0],
                                         loss_reduction=loss_reduction,
                                         loss_div_factor=loss_div_factor)

        return LMOutputWithLoss(logits=None, loss=finalize(ce_loss),
                                ce_loss=finalize(ce_loss.detach()), z_loss=None)

    def post_batch(self, dry_run=False):
        pass

    def reset_auxiliary_metrics(self):
        pass


def train_module(wrapped, seq_len, dp_config):  # TransformerTrainModule, its __init__ replaced
    module = TransformerTrainModule.__new__(TransformerTrainModule)
    state = dict(
        model=wrapped, _model_mode=None, label_ignore_index=-100, device=torch.device("cpu"),
        z_loss_multiplier=None, rank_microbatch_size=seq_len, autocast_precision=None,
        record_metric=lambda *args, **kwargs: None, _dp_config=dp_config,
    )
    for name, value in state.items():
        setattr(module, name, value)
    return module


input_ids = torch.stack([b["input_ids"] for b in batches])  # the window as one [K, L] batch
labels = torch.full_like(input_ids, -100)
labels[:, :-1] = torch.stack([b["labels"] for b in batches])[:, 1:]  # get_labels' shift
model = build_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
captured = []
wrapped = OLMoTransformer(model)
'''

_TRAIN = """
module = train_module(wrapped, input_ids.shape[1], dp_config)
module.train_batch({"input_ids": input_ids, "labels": labels}, dry_run=True)
optimizer.step()
grads = captured[0]
"""

BODY = (
    _WRAPPER
    + """dp_config = None  # one process: no data parallelism
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
"""
    + _TRAIN
    + """counted = f"batch_num_tokens_for_loss {wrapped.divisors[0]}"
"""
)

RANKS = (
    _WRAPPER
    + """init_distributed(backend="gloo")  # the group is up already: OLMo-core checks it, goes on
dp_config = TransformerDataParallelConfig(name=DataParallelType.fsdp)
world_mesh = build_world_mesh(dp=dp_config, device_type="cpu")
# What Transformer.apply_fsdp reads of a model without blocks, embeddings or head of its own.
shown = dict(blocks=torch.nn.ModuleDict(), embeddings=None, embedding_norm=None, lm_head=None,
             tie_word_embeddings=False, dtype=DTYPE)
for name, value in shown.items():
    setattr(wrapped, name, value)
reduce_dtype = torch.float64 if DTYPE == torch.float64 else torch.float32
Transformer.apply_fsdp(wrapped, dp_mesh=get_dp_model_mesh(world_mesh), reduce_dtype=reduce_dtype,
                       wrapping_strategy=dp_config.wrapping_strategy)


def whole_gradient():  # each rank holds a shard of every gradient: gathered whole, every rank
    grads = [p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
             for p in model.parameters()]
    return torch.cat([g.detach().double().flatten() for g in grads])


optimizer.register_step_pre_hook(lambda *_: captured.append(whole_gradient()))
"""
    + _TRAIN
    + """counted = f"its own batch_num_tokens_for_loss {wrapped.divisors[0]}, then FSDP's mean"
"""
)
