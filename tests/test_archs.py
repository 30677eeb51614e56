"""The architecture registry (app/archs/): one entry per architecture, which every consumer reads.

- The built model holds exactly the parameters its entry lists (`Arch.stage_params`): name, global
  shape, initialisation, decay, tie, ZeRO-3 unit, the sequence-parallel partial gradient and the box
  of each tp rank, for every registered architecture, on 1D tensor parallelism (with SP) and, where
  the entry allows it, 3D.
- A toy third architecture added as a registry entry and nothing else (`NARROW`: GPT-2 blocks with an
  MLP of 2 x hidden instead of 4 x) loads from a deck, is planned (memory, dry run, predicted step),
  is counted by the FLOP counter, trains on a tp2 pp2 grid equal to one rank (under mpirun -n 4) and
  exports to a Hugging Face GPT-2 directory whose logits are gridlm's.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import pytest
import torch

from app import archs
from app.archs.gpt2 import GPT2
from app.deck import load_deck, resolve_for_world
from app.errors import DeckError
from app.model.gpt import GPT, gpt_num_parameters
from app.plan.estimate import _box
from app.sharding.layout import coords3d
from app.tensor_parallel.mappings import TensorParallel
from app.tensor_parallel.tensor3d import Tensor3D
from conftest import REPO

TINY = REPO / "inputs/gpt_tiny.yaml"
SMALL = ("model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=4")
# The toy: GPT-2's features, another MLP width rule. Nothing outside this entry knows it.
NARROW = dataclasses.replace(GPT2, name="gpt_narrow", summary="GPT-2 with an MLP of 2 x hidden", ffn=lambda h: 2 * h)


@pytest.fixture
def narrow(monkeypatch):
    """The registry with the toy entry added (the registry is read-only: replaced, not mutated)."""
    monkeypatch.setattr(archs, "REGISTRY", MappingProxyType({**archs.REGISTRY, NARROW.name: NARROW}))
    return NARROW


def built(deck, tp, layers, first: bool, last: bool) -> list[tuple]:
    """(name, global shape, init, std, decay, tied, sequence_parallel, box) of each built parameter."""
    model = GPT(deck.model, 1, torch.device("meta"), tp, layers, first, last)
    return [
        (n, p.meta.global_shape, p.meta.init, p.meta.std, p.meta.decay, p.meta.tied, p.meta.sequence_parallel,
         (p.meta.local_offset, p.meta.local_shape, p.meta.split))
        for n, p in model.named_parameters()
    ]  # fmt: skip


def listed(deck, tp_size, tp_rank, tensor, sp, layers, first, last) -> list[tuple]:
    """The same tuples from the registry entry's list (`Arch.stage_params`)."""
    out = []
    for p in deck.model.spec.stage_params(deck.model, layers, first, last):
        box = _box(p, tp_size, tp_rank, tensor)
        # 1D: whole over tp but fed a sequence shard (SP); 3D: replicated over Z, which splits the batch.
        partial = box.sequence_parallel if tensor else p.seq_sharded and sp and tp_size > 1
        out.append((p.name, p.shape, p.init, p.std, p.decay, p.tied, partial,
                    (box.local_offset, box.local_shape, box.split)))  # fmt: skip
    return out


STAGES = [([0, 1, 2, 3], True, True), ([0, 1], True, False), ([2, 3], False, True)]


# Mixture of experts in blocks 0 and 2 (app/model/moe.py): a router, stacked experts and two shared ones,
# whole on every tp rank.
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=48", "model.moe_every=2",
       "model.moe_shared_experts=2")  # fmt: skip


@pytest.mark.parametrize("arch", archs.names())
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_built_model_holds_exactly_the_listed_parameters_on_1d_tp(arch, tie, tp, sp, moe):
    kv = ("model.kv_heads=2",) if archs.get(arch).grouped_query else ()
    deck = load_deck(TINY, (*SMALL, f"model.arch={arch}", *kv, f"model.tie_embeddings={tie}", *(MOE if moe else ())))
    for layers, first, last in STAGES:
        for rank in range(tp):
            tpp = TensorParallel(tp, rank, sequence_parallel=sp)
            assert built(deck, tpp, layers, first, last) == listed(deck, tp, rank, None, sp, layers, first, last)
        # The weights whose gradient GEMM may add into the accumulator (train.fuse_grad_accumulation):
        # the builder's marks are the list's `linear` (the performance model counts them from it).
        model = GPT(
            deck.model, 1, torch.device("meta"), TensorParallel(tp, 0, sequence_parallel=sp), layers, first, last
        )
        marked = [n for n, p in model.named_parameters() if getattr(p, "wgrad_fusable", False)]
        assert marked == [p.name for p in deck.model.spec.stage_params(deck.model, layers, first, last) if p.linear]
        assert marked and all(n.endswith(".weight") or n == "head" for n in marked)
    # The ZeRO-3 gather units too: the first of `GPT.param_units` to hold each parameter (a tied
    # embedding on a one-stage model is in "embed" and again in "head").
    model = GPT(deck.model, 1, torch.device("meta"))
    units: dict[int, str] = {}
    for unit, params in model.param_units():
        for p in params:
            units.setdefault(id(p), unit)
    assert [units[id(p)] for p in model.parameters()] == [
        p.unit for p in deck.model.spec.stage_params(deck.model, range(4), True, True)
    ]


@pytest.mark.parametrize("arch", [a for a in archs.names() if archs.get(a).tensor3d])
@pytest.mark.parametrize("tensor", [(2, 1, 1), (1, 2, 2), (2, 2, 1)])
def test_the_built_model_holds_exactly_the_listed_parameters_on_3d_tp(arch, tensor):
    x, y, z = tensor
    deck = load_deck(TINY, (*SMALL, f"model.arch={arch}", f"parallel.tp={x * y * z}",
                            f"parallel.tensor=[{x}, {y}, {z}]", "train.global_batch=16"))  # fmt: skip
    for layers, first, last in STAGES:
        for rank in range(x * y * z):
            xr, yr, zr = coords3d(rank, tensor)
            t3d = Tensor3D(TensorParallel(x, xr), TensorParallel(y, yr), TensorParallel(z, zr))
            assert built(deck, t3d, layers, first, last) == listed(deck, x * y * z, rank, tensor, False, layers,
                                                                   first, last)  # fmt: skip


def test_a_list_that_is_not_the_model_is_caught(monkeypatch):
    """The comparison above can fail: a gpt2 entry that said RMSNorm (no norm biases) lists other
    parameters than the LayerNorm blocks built from the real entry hold."""
    deck = load_deck(TINY, SMALL)
    made = built(deck, TensorParallel(2, 1), [0, 1], True, False)
    monkeypatch.setattr(
        archs, "REGISTRY", MappingProxyType({**archs.REGISTRY, "gpt2": dataclasses.replace(GPT2, norm="rmsnorm")})
    )
    wrong = listed(deck, 2, 1, None, False, [0, 1], True, False)
    assert made != wrong and {"blocks.0.ln1.bias", "blocks.1.ln2.bias"} <= {t[0] for t in made} - {t[0] for t in wrong}


# ---- a toy third architecture: a registry entry, nothing else ------------------------------------


def test_the_toy_entry_is_refused_until_registered_then_loads_with_its_own_width_rule(monkeypatch):
    with pytest.raises(DeckError, match=r"model.arch = 'gpt_narrow': accepted: gpt2, llama"):
        load_deck(TINY, (*SMALL, "model.arch=gpt_narrow"))
    monkeypatch.setattr(archs, "REGISTRY", MappingProxyType({**archs.REGISTRY, NARROW.name: NARROW}))
    m = load_deck(TINY, (*SMALL, "model.arch=gpt_narrow")).model
    assert (m.ffn, m.fc_rows, m.tie_embeddings) == (64, 64, True)  # 2 x hidden; GPT-2's tie default
    # 12 tensors a block, as GPT-2; 4h^2 + 2 h f + 9h + f per block with f = 2h (GPT-2's is 4h).
    h, f = 32, 64
    block = 4 * h * h + 2 * h * f + 9 * h + f
    assert gpt_num_parameters(m) == 64 * h + 16 * h + 4 * block + 2 * h
    assert gpt_num_parameters(m) == sum(p.numel() for p in GPT(m, 1, torch.device("meta")).parameters())


def test_the_toy_is_planned_and_counted_by_the_flop_counter(narrow):
    from app.metrics.flops import arch_flops_args, gpt_step_flops, step_flops
    from app.plan.dryrun import make_plan
    from app.plan.estimate import estimate_stages
    from app.plan.machine import load_machine

    sets = (*SMALL, "model.arch=gpt_narrow", "parallel.tp=2", "parallel.pp=2", "train.global_batch=8")
    deck = resolve_for_world(load_deck(TINY, sets), 4)
    wide = resolve_for_world(load_deck(TINY, (*sets[:-4], *sets[-3:])), 4)  # the same deck as gpt2
    stages = estimate_stages(deck)
    assert sum(s.params for s in stages) < sum(s.params for s in estimate_stages(wide))
    for stage, (layers, first, last) in enumerate([([0, 1], True, False), ([2, 3], False, True)]):
        model = GPT(deck.model, 1, torch.device("meta"), TensorParallel(2, 0), layers, first, last)
        assert stages[stage].params == sum(p.numel() for p in model.parameters())
    plan = make_plan(deck, 4, load_machine("dgx_h100"))
    assert not plan.problems and plan.predicted is not None and plan.predicted.step_time_s > 0
    # The FLOP counter: 6 FLOPs a token per weight element of the blocks' Linears and the head, and
    # 12 s h a token per layer for the attention scores and context (Megatron's count, full attention).
    m, tokens = deck.model, deck.train.global_batch * deck.model.seq_len
    linear = sum(p.numel for p in m.spec.block_params(m) if len(p.shape) == 2) * m.layers + m.vocab_size * m.hidden
    want = 6 * tokens * linear + 12 * tokens * m.layers * m.seq_len * m.hidden
    assert step_flops(deck)["model"] == pytest.approx(want, rel=1e-12)
    assert gpt_step_flops(8, 16, 4, 32, 64, m.ffn, **arch_flops_args(m)) == pytest.approx(want, rel=1e-12)
    assert step_flops(wide)["model"] > want  # the 4h MLP of gpt2 costs more


STEPS = 4
# Tolerance (fp32), as tests/test_parallel_equivalence.py argues: the grid only regroups sums.
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
TOY_RUN = (
    *SMALL, "model.arch=gpt_narrow", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
    "optim.lr=3.0e-3", "optim.warmup_steps=1", "data.noise=0.1", "run.log_every=100",
)  # fmt: skip


@pytest.mark.mpi(min_size=4)
def test_the_toy_trains_on_tp2_pp2_as_on_one_rank_and_exports_to_hugging_face(runtime, grids, tmp_path, narrow):
    import h5py

    from app.checkpoint.export import export_hf
    from app.checkpoint.io import decode
    from app.parallel.gather import gather_parameters
    from app.runtime.mpi import settle
    from app.train import Trainer
    from conftest import reference_run, shard_errors, train_steps

    run_dir = runtime.comm.bcast(str(tmp_path), root=0)
    ref_losses, ref_params = reference_run(grids, (*TOY_RUN, f"run.dir={run_dir}/solo"), STEPS, {})
    sub = grids.runtime(4)
    deck = resolve_for_world(
        load_deck(TINY, (*TOY_RUN, "parallel.tp=2", "parallel.pp=2", f"run.dir={run_dir}/grid")), 4
    )
    grid = grids.grid(2, 2, 1, deck.parallel.order)
    losses, problems, path = None, [], None
    if grids.trains(4):
        trainer = Trainer(deck, sub, grid)
        losses = train_steps(trainer, STEPS)
        problems, _ = shard_errors(trainer.model, ref_params, PARAM_ATOL, runtime.rank)
        full = gather_parameters(trainer.model, grid, sub.comm)
        if sub.is_root and set(full) != set(ref_params):
            problems.append(f"gathered {sorted(full)} != {sorted(ref_params)}")
        path = trainer.save("test").path
    else:
        grids.stand_by(grid, 1)
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    losses = next(x for x in runtime.comm.allgather(losses) if x is not None)
    path = next(x for x in runtime.comm.allgather(path) if x is not None)
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), (losses, ref_losses)
    assert losses[-1] < losses[0]
    assert not problems, "\n".join(problems)
    if runtime.rank != 0:
        return
    # Export on one process; Hugging Face's GPT-2 with n_inner = 2h gives the grid-trained model's logits.
    import transformers

    export_hf(path, tmp_path / "hf")
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.n_inner == 64
    ours = GPT(deck.model, seed=0)
    with h5py.File(path, "r") as f, torch.no_grad():
        for name, param in ours.named_parameters():
            dset = f[f"model/{name}"]
            param.copy_(decode(dset[()], dset.attrs["dtype"]).view(param.shape))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        mine, theirs = ours.eval()(tokens), hf.eval()(tokens).logits
    # Same fp32 weights, op order apart (tests/test_checkpoint_tools.py: measured 6e-7 at this size).
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert math.isfinite(mine.abs().max().item())
