"""Any grid = one rank: tensor x pipeline x data training equals the 1-rank run.

Run under `mpirun -n 8`. Each case splits the 8 ranks into 8 / (tp x pp x dp)
sub-communicators; the last of them trains the grid, and the others make the same groups
and stand by (every rank takes part in every case: torch names a locally synchronised
group by its ranks and the number of groups the process already made, so all ranks must
create the same number of groups). World rank 0 trains the same deck on one rank as the
reference. The grids are made once per shape
and reused by the cases (tests/conftest.py, GridPool). After each of 5 optimizer steps
the global-batch loss must equal the reference's; afterwards every rank's parameter
shards must equal the same slices of the reference, and the gathered full parameters too.

Tiers: the cases marked quick=True (a third, chosen to exercise every axis size, 3D sub-axis and
deck setting of the matrix: test_the_quick_cases_cover_every_setting_of_the_matrix) run in every
`launch/test.sh`; the others are marked `full` and run with `launch/test.sh --full`
(docs/TESTING.md).

Tolerance (fp32): the runs differ only in summation order — tp splits every matmul's
inner sum (row-parallel layers) and the softmax denominator over vocab shards, dp and
gradient accumulation regroup the batch sum, sequence parallelism regroups the
LayerNorm-gradient sums. Each is ~1e-7 relative per operation; over 5 Adam steps
(which normalise small gradients and so can amplify relative noise in them) the worst
cases measured over all the cases below were 1.2e-7 relative on the loss and 4.7e-6
absolute on a parameter (typical size 2e-2). We allow 1e-5 relative on losses and 2e-5
absolute on parameters — 4x above the worst parameter error, still far below a real bug
(a wrong shard or a missing gradient term moves the loss at the 1e-3 level within two
steps and parameters by ~lr = 3e-3).

3D tensor parallelism (parallel.tensor [x, y, z]) only regroups sums too: partial products over
X or Y, LayerNorm statistics over X, the batch's gradients over Z. Over its cases below the worst
measured errors were 2.3e-7 relative on the loss and 9.0e-6 absolute on a parameter (Y = 8): the
same tolerances hold.

The same holds with the overlaps on or off, with ZeRO-1, -2 and -3, gradient accumulation 1 or 4,
LAMB and recomputation (all exact rearrangements of the same fp32 arithmetic), and with the Goldfish
loss mask (the same targets dropped on every grid; the weighted sum regroups like the mean). Gradient
accumulation fused into the weight-gradient GEMMs (an addmm into the accumulator, against the unfused
1-rank run) measured at most 2.3e-7 relative on the loss and 5.2e-6 absolute on a parameter.

Mixed precision (bf16, fp16 with loss scaling) is compared with the 1-rank run in the same
precision (and gradient-reduction dtype). Rounding to 8 (bf16) or 11 (fp16) significant bits
after a different summation order is the only difference, but Adam normalises each gradient
element, so a low-precision gradient near zero can flip an element's step: such an element
drifts by up to 2 x (sum of the 5 learning rates) ~ 1.9e-2, however correct the grid. Measured
against the same-precision reference: loss 7.6e-5 and 9.7e-5 (bf16) and 2.1e-6 (fp16)
relative; the worst element 1.0e-2 and 1.1e-2 (bf16) and 9.6e-4 (fp16); the mean error of the
worst tensor 1.4e-3 (bf16) and 1.1e-4 (fp16). The attention's key bias has an exactly zero
gradient (a softmax does not change when every score of a query moves by the same q . b), so
its gradient is rounding noise alone, and Adam turns that noise into steps of the full learning
rate: in fp16 the noise clears Adam's epsilon, and which CPU kernels ran decides it. On an
AVX-512 Xeon (2026-11-28) the fp16 3D case's last qkv bias was off by 4.9e-3 in one element
and 5.2e-4 on average (16 of its 48 elements are key biases), where an earlier machine measured
9.6e-4 and 1.1e-4. We allow, bf16: loss 5e-4, element 2e-2 (the bound above), tensor mean
3e-3; fp16: loss 2e-5, element 2e-2 (the same bound), tensor mean 1.5e-3 (about 3x the worst
measured). A real bug breaks them: with the sequence-parallel LayerNorm gradients left unsummed over tp in bf16 (a
mutation of DataParallel.finish_grad_reduce), the sp bf16 case's loss was off by 1.5e-3
relative and a tensor's mean error was 5.5e-3, while its worst element (1.6e-2) stayed inside
the element bound: the mean and the loss are the sharp checks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from app.deck import load_deck, resolve_for_world
from app.parallel.gather import gather_parameters
from app.train import Trainer
from conftest import REPO, grid_trainer, reference_run, settle, shard_errors, train_steps

STEPS = 5
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
BF16_LOSS_RTOL, BF16_PARAM_ATOL, BF16_PARAM_MEAN_ATOL = 5e-4, 2e-2, 3e-3
FP16_LOSS_RTOL, FP16_PARAM_ATOL, FP16_PARAM_MEAN_ATOL = 2e-5, 2e-2, 1.5e-3
TINY = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=4",
    f"train.steps={STEPS}", "train.global_batch=16", "train.micro_batch=2",
    "optim.lr=3.0e-3", "optim.warmup_steps=2", "data.noise=0.1", "run.log_every=100",
    "parallel.dp_bucket_mb=0.02",  # ~5,000 fp32 gradients per bucket: about a dozen buckets per stage
)  # fmt: skip
OVERLAP_OFF = tuple(f"parallel.overlap_{k}=false" for k in ("grad_reduce", "param_gather", "tp_comm", "pp_comm"))
# Keys the 1-rank reference shares with the case (the model and the update rule).
REFERENCE_KEYS = (
    "model.", "optim.name", "train.precision", "train.grad_reduce_dtype", "train.loss_scale", "train.goldfish",
)  # fmt: skip
# The Goldfish loss mask: k = 3 drops about a third of the targets after the first h = 4 of a sample.
GOLDFISH = ("train.goldfish_k=3", "train.goldfish_context=4")


class Case(NamedTuple):
    tp: int
    pp: int
    dp: int
    sp: bool = False
    virtual: int = 1
    extra: tuple[str, ...] = ()
    loss_rtol: float = LOSS_RTOL
    param_atol: float = PARAM_ATOL
    param_mean_atol: float = math.inf  # mixed precision: the mean error per tensor (module docstring)
    tensor: tuple[int, int, int] | None = None  # 3D tensor parallelism's [x, y, z] (x y z = tp)
    ep: int = 1  # expert parallelism (a mixture of experts' experts split over ep dp ranks)
    cp: int = 1  # context parallelism (every sequence split over cp ranks)
    quick: bool = False  # in the covering subset every tier runs (the rest: launch/test.sh --full)

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def id(self) -> str:
        tp = "x".join(map(str, self.tensor)) if self.tensor else self.tp
        tags = [f"tp{tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"pp{self.pp}", f"dp{self.dp}"]
        tags += ["sp"] if self.sp else []
        tags += [f"ep{self.ep}"] if self.ep > 1 else []
        tags += [f"interleaved{self.virtual}"] if self.virtual > 1 else []
        if self.extra == OVERLAP_OFF:
            return "-".join(tags + ["overlap-off"])
        return "-".join(tags + [e.split(".")[-1].replace("=", "").replace("overlap_", "no-") for e in self.extra])

    def overrides(self) -> tuple[str, ...]:
        return (
            f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
            f"parallel.sequence_parallel={str(self.sp).lower()}", f"parallel.virtual_stages={self.virtual}",
            *([f"parallel.tensor={list(self.tensor)}"] if self.tensor else []), f"parallel.ep={self.ep}",
            f"parallel.cp={self.cp}", *self.extra,
        )  # fmt: skip


# Every grid with tp, pp, dp in {1, 2}; with and without SP; 1F1B and interleaved; tp = 4 and
# pp = 4 where they fit 8 ranks and 4 layers; other orders, an uneven stage split, an untied head.
CASES = [
    Case(2, 1, 1), Case(2, 1, 1, sp=True), Case(1, 2, 1), Case(1, 2, 1, virtual=2), Case(1, 1, 2),
    Case(2, 2, 1), Case(2, 2, 1, sp=True), Case(2, 2, 1, virtual=2), Case(2, 1, 2), Case(2, 1, 2, sp=True),
    Case(1, 2, 2), Case(1, 2, 2, virtual=2),
    Case(2, 2, 2), Case(2, 2, 2, sp=True), Case(2, 2, 2, virtual=2), Case(2, 2, 2, sp=True, virtual=2, quick=True),
    Case(4, 1, 1), Case(4, 1, 1, sp=True), Case(4, 2, 1, sp=True), Case(4, 1, 2, quick=True),
    Case(1, 4, 1, quick=True), Case(1, 4, 2), Case(2, 4, 1, sp=True),
    Case(2, 2, 2, extra=("parallel.order=pp-dp-tp",), quick=True),
    Case(1, 2, 2, extra=("parallel.stage_layers=[1, 3]",), quick=True),
    Case(2, 2, 2, sp=True, extra=("model.tie_embeddings=false",)),
    # Overlap off (every switch) equals overlap on (the default in every case above).
    Case(2, 2, 2, sp=True, virtual=2, extra=OVERLAP_OFF), Case(1, 1, 2, extra=OVERLAP_OFF, quick=True),
    # ZeRO-1, with and without overlap; accumulation 1 vs 4 (micro_batch 8 vs 2) at the same global batch.
    Case(1, 1, 2, extra=("optim.zero=1",)), Case(2, 2, 2, sp=True, extra=("optim.zero=1",)),
    Case(1, 2, 2, virtual=2, extra=("optim.zero=1", *OVERLAP_OFF[:2])),
    Case(1, 1, 2, extra=("train.micro_batch=8",), quick=True), Case(2, 1, 2, extra=("optim.zero=1", "train.micro_batch=8")),
    # LAMB: the trust ratio from tp- and ZeRO-sharded norms equals the 1-rank one.
    Case(2, 2, 2, sp=True, extra=("optim.name=lamb", "optim.zero=1"), quick=True), Case(2, 1, 2, extra=("optim.name=lamb",)),
    # Recomputation changes nothing numerically.
    Case(2, 2, 2, sp=True, extra=("train.recompute=full", "optim.zero=1")),
    Case(2, 1, 2, extra=("train.recompute=selective",)),
]  # fmt: skip
# Mixed precision against the 1-rank run in the same precision: tolerances in the module docstring.
BF16 = {"loss_rtol": BF16_LOSS_RTOL, "param_atol": BF16_PARAM_ATOL, "param_mean_atol": BF16_PARAM_MEAN_ATOL}
FP16 = {"loss_rtol": FP16_LOSS_RTOL, "param_atol": FP16_PARAM_ATOL, "param_mean_atol": FP16_PARAM_MEAN_ATOL}
CASES += [
    Case(2, 1, 2, extra=("optim.zero=1", "train.precision=bf16"), **BF16),
    Case(2, 2, 2, sp=True, extra=("train.precision=bf16", "train.grad_reduce_dtype=compute"), **BF16, quick=True),
    Case(1, 2, 2, extra=("optim.zero=1", "train.precision=fp16"), **FP16, quick=True),
    # ZeRO-2: dp alone (overlap on and off); with tp, pp and SP; with interleaving, recompute and bf16.
    Case(1, 1, 2, extra=("optim.zero=2",)), Case(1, 1, 2, extra=("optim.zero=2", *OVERLAP_OFF[:2])),
    Case(2, 2, 2, sp=True, extra=("optim.zero=2",)),
    Case(1, 2, 2, virtual=2, extra=("optim.zero=2", "train.recompute=full", "train.precision=bf16"), **BF16, quick=True),
    # ZeRO-3: the same three, and an untied head on one stage (the embedding and head apart).
    Case(1, 1, 2, extra=("optim.zero=3",)), Case(1, 1, 2, extra=("optim.zero=3", *OVERLAP_OFF[:2])),
    Case(2, 2, 2, sp=True, extra=("optim.zero=3",)),
    Case(1, 2, 2, virtual=2, extra=("optim.zero=3", "train.recompute=full", "train.precision=bf16"), **BF16, quick=True),
    Case(2, 1, 2, extra=("optim.zero=3", "model.tie_embeddings=false", "train.recompute=selective"), quick=True),
    # Optimizer offload to host memory and to NVMe files (a 0.05 MB buffer: many chunks per bucket),
    # on dp2 and tp2 dp2; with LAMB (host only), bf16 masters, ZeRO-1, -2 and -3.
    Case(1, 1, 2, extra=("optim.offload=host", "optim.zero=2"), quick=True),
    Case(2, 1, 2, extra=("optim.offload=host", "optim.zero=1", "optim.name=lamb", "train.precision=bf16"), **BF16),
    Case(1, 1, 2, extra=("optim.offload=nvme", "optim.offload_buffer_mb=0.05"), quick=True),
    Case(2, 1, 2, extra=("optim.offload=nvme", "optim.offload_buffer_mb=0.05", "optim.zero=3")),
]  # fmt: skip


def t3d(shape: tuple[int, int, int], pp: int, dp: int, *extra: str, **kwargs) -> Case:
    """A case under 3D tensor parallelism: parallel.tensor = [x, y, z], tp = x y z."""
    return Case(math.prod(shape), pp, dp, extra=extra, tensor=shape, **kwargs)


# 3D tensor parallelism (parallel.tensor [x, y, z]): every factorisation of 2, 4 and 8 once, on all 8
# ranks (product 2 with pp2 dp2, 4 with pp2 or dp2, 8 alone), with bf16, recompute (full, selective),
# ZeRO-1, -2, -3 and an untied head among them; then a few combinations again on a second shape.
# Y = 8 splits the heads: 8 of them (head size 4). Each collective of 8 ranks on a couple of cores
# costs far more than the arithmetic, so the larger grids take 2 micro-batches of 8 / z samples per
# step (accumulation 2) instead of 8 / z of 2.
MB8, MB4 = "train.micro_batch=8", "train.micro_batch=4"
CASES += [
    t3d((2, 1, 1), 2, 2), t3d((1, 2, 1), 2, 2, "optim.zero=1"),
    t3d((1, 1, 2), 2, 2, "train.precision=bf16", **BF16, quick=True),
    t3d((2, 2, 1), 2, 1, "train.recompute=full"), t3d((2, 1, 2), 1, 2, "optim.zero=2"),
    t3d((1, 2, 2), 2, 1, "model.tie_embeddings=false"), t3d((4, 1, 1), 1, 2, "train.recompute=selective"),
    t3d((1, 4, 1), 2, 1), t3d((1, 1, 4), 1, 2, "optim.zero=3", quick=True),
    t3d((8, 1, 1), 1, 1, MB8), t3d((1, 8, 1), 1, 1, MB8, "model.heads=8", quick=True), t3d((1, 1, 8), 1, 1),
    t3d((4, 2, 1), 1, 1, MB8), t3d((4, 1, 2), 1, 1, MB4), t3d((2, 4, 1), 1, 1, MB8), t3d((1, 4, 2), 1, 1, MB4),
    t3d((2, 1, 4), 1, 1), t3d((1, 2, 4), 1, 1), t3d((2, 2, 2), 1, 1, MB4),
    t3d((2, 2, 1), 1, 2, MB4, "optim.zero=3", "model.tie_embeddings=false"),
    # LAMB's trust ratio from 3D shards (some replicated over X or Y, counted once); fp16.
    t3d((2, 1, 2), 1, 2, "optim.name=lamb", "optim.zero=1"),
    t3d((1, 2, 2), 1, 2, "optim.zero=1", "train.precision=fp16", **FP16),
    # Every 3D overlap (OAR, ORS, OAG) is on above (the defaults); here all off, and on again with a
    # full recomputation over Z (the recomputed forward prefetches the gathers backward takes).
    t3d((2, 2, 2), 1, 1, MB4, "parallel.overlap_tp_comm=false", "parallel.overlap_tensor_reduce_scatter=false",
        "parallel.overlap_tensor_all_gather=false", quick=True),
    t3d((1, 2, 2), 2, 1, "train.recompute=full"),
    # Another order of the sub-axes in the tp group (parallel.tensor_order, innermost first): the
    # same blocks on other ranks, so the same sums.
    t3d((2, 2, 2), 1, 1, MB4, "parallel.tensor_order=zyx", quick=True),
    t3d((2, 1, 2), 1, 2, "parallel.tensor_order=zxy", "optim.zero=1", quick=True),
]  # fmt: skip
# Goldfish: the mask comes from the targets before any split, and the loss is the mean over the
# global batch's counted targets (their count summed over dp and Z): the same on every grid.
CASES += [
    Case(2, 1, 1, extra=GOLDFISH), Case(1, 2, 1, extra=GOLDFISH), Case(1, 1, 2, extra=GOLDFISH),
    Case(2, 1, 2, sp=True, extra=GOLDFISH, quick=True), t3d((2, 1, 2), 1, 2, *GOLDFISH),
]  # fmt: skip


# llama blocks (model.arch: llama: RMSNorm, rotary positions, SwiGLU, no biases, untied head): grouped-
# query attention (2 key/value heads for 4 query heads, tp 2 gives each rank one group) with SP, pp
# and dp; with ZeRO-1 on dp 4; bf16; and without GQA, tied, ZeRO-1 over pp 2 (the tied head's copy).
LLAMA = ("model.arch=llama", "model.kv_heads=2")
CASES += [
    Case(2, 2, 2, sp=True, extra=LLAMA, quick=True),
    Case(2, 1, 4, extra=(*LLAMA, "optim.zero=1")),
    Case(2, 2, 2, extra=(*LLAMA, "train.precision=bf16"), **BF16),
    Case(2, 2, 2, extra=("model.arch=llama", "model.tie_embeddings=true", "optim.zero=1"), quick=True),
    # run.compile: llama's RMSNorm, rotary embedding and SwiGLU, and the blocks' residual add + norm
    # chains, as torch.compile kernels, against the eager 1-rank run, under tp, SP, pp and dp, and
    # inside full recomputation with ZeRO-3.
    Case(2, 2, 2, sp=True, extra=(*LLAMA, "run.compile=true")),
    Case(2, 1, 2, extra=(*LLAMA, "run.compile=true", "train.recompute=full", "optim.zero=3"), quick=True),
    # GPT-2 compiled: the row-parallel output biases joined to the residual adds and ln2 (the bias
    # added after tp's reduction, on the sequence shard under SP).
    Case(2, 2, 2, sp=True, extra=("run.compile=true",)),
    Case(2, 1, 2, sp=True, extra=("run.compile=true", "train.recompute=full", "optim.zero=3"), quick=True),
]

# Gradient accumulation fusion (train.fuse_grad_accumulation; null = GPUs only): each block Linear's
# and an untied head's weight-gradient GEMM writes or adds into its accumulator (4 micro-batches a
# step here), against the unfused 1-rank run: tp's column- and row-parallel Linears with SP and pp;
# the plain Linear path (tp 1) with ZeRO-2's bucket buffers; llama's head with ZeRO-1; ZeRO-3 with
# recomputation and bf16 (no mixed-dtype GEMM on CPU: the hook's rounding there). An addmm rounds
# once where mm-then-add rounds twice: a summation-order change, inside the fp32 tolerances.
FUSE = "train.fuse_grad_accumulation=true"
CASES += [
    Case(2, 2, 2, sp=True, extra=(FUSE, "model.tie_embeddings=false"), quick=True),
    Case(1, 1, 2, extra=(FUSE, "optim.zero=2"), quick=True),
    Case(2, 1, 2, extra=(*LLAMA, FUSE, "optim.zero=1")),
    Case(1, 2, 2, virtual=2, extra=(FUSE, "optim.zero=3", "train.recompute=full", "train.precision=bf16"), **BF16),
]

# Mixture of experts (app/model/moe.py) with a shared expert: the experts whole on every tp rank (under
# SP each routes its sequence shard), under pp and dp with ZeRO-1; with a capacity factor of 1 (some assignments
# dropped), the same ones on every grid.
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=32", "model.moe_z_loss_coef=0.001",
       "model.moe_shared_experts=1")  # fmt: skip
CASES += [
    Case(2, 2, 2, extra=MOE),
    Case(2, 2, 2, sp=True, extra=(*LLAMA, *MOE, "model.moe_aux_loss_coef=0.5")),
    Case(
        1, 2, 2, extra=(*LLAMA, *MOE, "model.moe_capacity_factor=1.0", "model.moe_every=2", "optim.zero=1"), quick=True
    ),
]
# Expert parallelism: 2 or 4 experts per rank, tokens exchanged by all-to-all, expert gradients reduced
# over the dp / ep ranks holding the same experts (with ZeRO-1 sharded over them; LAMB's and the clipped
# norm's expert parts summed over ep); with a capacity factor, the source ranks drop what one rank drops.
CASES += [
    Case(1, 1, 4, ep=2, extra=(*MOE, "optim.name=lamb"), quick=True),
    Case(2, 1, 2, sp=True, ep=2, extra=(*LLAMA, *MOE)),
    Case(1, 2, 4, ep=4, extra=(*LLAMA, *MOE, "model.moe_capacity_factor=1.0"), quick=True),
    Case(1, 2, 4, ep=2, extra=(*MOE, "optim.zero=1")),
    Case(1, 1, 4, ep=2, extra=(*LLAMA, *MOE, "train.precision=bf16"), **BF16),
]

# Context parallelism (parallel.cp): every sequence split over the cp ranks (rank i holds chunks i and
# 2 cp - 1 - i), causal attention over the whole of it by the ring (key/value blocks passed around,
# softmax merged by log-sum-exp in fp32) or the all-to-all (heads split over cp around attention);
# gradients averaged over dp x cp. The ring at seq 256 on cp 2 and 4; with tp and SP, pp, llama's
# GQA and rotary positions, ZeRO-1 and -3 (sharded over dp x cp), full and selective recompute, bf16.
SEQ256 = ("model.seq_len=256",)
A2A = ("parallel.cp_kind=all_to_all",)
CASES += [
    Case(1, 1, 1, cp=2, extra=SEQ256, quick=True), Case(1, 1, 1, cp=4, extra=SEQ256, quick=True),
    Case(2, 1, 2, cp=2, sp=True), Case(1, 2, 1, cp=2), Case(1, 2, 2, cp=2, extra=(*LLAMA, "optim.zero=1")),
    Case(1, 1, 1, cp=2, extra=A2A, quick=True), Case(2, 1, 1, cp=2, extra=(*A2A, *LLAMA)),
    Case(1, 1, 2, cp=2, extra=("train.recompute=full", "optim.zero=3")),
    # dp inner to cp: the dp x cp replicas in ascending rank order are not dp-major, and ZeRO's shards
    # follow torch's order of the group (found in review: they followed dp-major, and were wrong).
    Case(1, 1, 2, cp=2, extra=("parallel.order=dp-cp-tp-pp", "optim.zero=1"), quick=True),
    Case(2, 1, 2, cp=2, extra=("parallel.order=dp-cp-tp-pp", "optim.zero=3")),
    Case(2, 1, 1, cp=2, extra=("train.recompute=selective",)),
    Case(1, 1, 2, cp=2, extra=("train.precision=bf16",), **BF16),
    # Goldfish: the masks from the whole targets (every cp rank holds the whole samples), the
    # weights split with them; each cp rank's weighted sum counts cp times (the mean over dp x cp).
    Case(2, 1, 2, cp=2, sp=True, extra=GOLDFISH),
    # Mixture of experts (dropless): each cp rank routes its chunks; the load-balancing and z-losses'
    # token sums over cp (and tp under SP), each rank's share of their gradient counted cp times.
    Case(1, 1, 2, cp=2, extra=(*MOE, "model.moe_aux_loss_coef=0.5"), quick=True),
    Case(2, 1, 2, cp=2, sp=True, extra=(*LLAMA, *MOE, "model.moe_aux_loss_coef=0.5"), quick=True),
]  # fmt: skip

_REFERENCES: dict = {}


def _reference(grids, extra: tuple[str, ...], run_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The 1-rank run of the deck with the REFERENCE_KEYS of `extra` (conftest.reference_run)."""
    shared = tuple(e for e in extra if e.startswith(REFERENCE_KEYS))
    return reference_run(grids, (*TINY, *shared, f"run.dir={run_dir}"), STEPS, _REFERENCES)


def features(case: Case) -> set[str]:
    """What a case exercises: each split axis with its size (3D: the sub-axes split and their
    product), SP, interleaving, and every extra deck setting."""
    found = {f"{axis}={getattr(case, axis)}" for axis in ("pp", "dp", "cp", "ep") if getattr(case, axis) > 1}
    if case.tensor:
        found |= {f"tensor.{axis}" for axis, n in zip("xyz", case.tensor) if n > 1} | {f"tensor={case.tp}"}
    elif case.tp > 1:
        found.add(f"tp={case.tp}")
    found |= ({"sp"} if case.sp else set()) | ({f"virtual={case.virtual}"} if case.virtual > 1 else set())
    return found | set(case.extra)


def test_the_quick_cases_cover_every_setting_of_the_matrix():
    """The quick tier (every CI run) trains a third of the cases: together they must exercise every
    axis size, 3D sub-axis, switch and deck setting that any case does, so that a new setting added
    to the matrix alone fails here until one of its cases is marked quick."""
    quick = set().union(*(features(c) for c in CASES if c.quick))
    missing = set().union(*(features(c) for c in CASES)) - quick
    assert not missing, f"no quick=True case exercises {sorted(missing)}"
    assert 0 < sum(c.quick for c in CASES) < len(CASES)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if c.quick else pytest.mark.full) for c in CASES])
def test_grid_matches_single_rank_losses_and_parameters(runtime, grids, tmp_path, case):
    ref_losses, ref_params = _reference(grids, case.extra, tmp_path / "solo")
    size = case.size
    sub = grids.runtime(size)
    run_dir = sub.comm.bcast(str(tmp_path / "grid"), root=0)
    deck = resolve_for_world(
        load_deck(REPO / "inputs/gpt_tiny.yaml", (*TINY, *case.overrides(), f"run.dir={run_dir}")), size
    )
    grid = grids.grid(case.tp, case.pp, case.dp, deck.parallel.order, case.cp)
    if case.tensor:  # the sub-axes' groups: made by every copy, like the pipeline's (GridPool.stand_by)
        grid.tensor3d(case.tensor, deck.parallel.tensor_order)
    if case.ep > 1:  # the expert groups, likewise
        grid.expert_groups(case.ep)
    losses, problems, worst = None, [], 0.0
    if grids.trains(size):
        trainer = Trainer(deck, sub, grid)
        if case.tensor and (getattr(trainer.tp, "shape", None), getattr(trainer.tp, "order", None)) != (
            case.tensor,
            deck.parallel.tensor_order,
        ):
            problems.append(f"trained on tp {trainer.tp}, not the 3D grid {case.tensor} {deck.parallel.tensor_order}")
        if (FUSE in case.extra) != (trainer.dp.fused_wgrads > 0):  # the fused path is the one under test
            problems.append(
                f"{trainer.dp.fused_wgrads} weights fuse their gradients with {FUSE!r} {FUSE in case.extra}"
            )
        chained = [b.add_norm is not None for b in trainer.model.blocks.values()]
        if chained and any(chained) != ("run.compile=true" in case.extra):  # the compiled chains are under test
            problems.append(f"blocks' compiled chains {chained} with run.compile {'run.compile=true' in case.extra}")
        losses = train_steps(trainer, STEPS)
        with trainer.dp.gathered():  # ZeRO-3 keeps only shards: the whole parameters for the checks
            found, worst = shard_errors(trainer.model, ref_params, case.param_atol, runtime.rank, case.param_mean_atol)
            problems += found
            full = gather_parameters(trainer.model, grid, sub.comm)
        if sub.is_root:
            if set(full) != set(ref_params):
                problems.append(f"gathered {sorted(full)} != {sorted(ref_params)}")
            for name in set(full) & set(ref_params):
                error = (full[name].float() - ref_params[name].float()).abs().max().item()
                if error > case.param_atol:
                    problems.append(f"gathered {name} off by {error:.2e}")
    else:
        grids.stand_by(grid, deck.parallel.virtual_stages)
    settle(runtime.comm)  # the copies that stood by wait for the one that trains
    problems = sum(runtime.comm.allgather(problems), [])
    worst = max(runtime.comm.allgather(worst))
    losses = next(x for x in runtime.comm.allgather(losses) if x is not None)  # the training copy's
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if runtime.is_root:
        print(f"\n{case.id}: max loss rel error {loss_error:.1e}, max parameter error {worst:.1e}")
    assert losses == pytest.approx(ref_losses, rel=case.loss_rtol), f"{case.id}: {losses} vs {ref_losses}"
    assert losses[-1] < losses[0]  # it learns
    assert not problems, "\n".join(problems)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [0, 1])
def test_the_gradient_norm_under_context_parallelism_is_the_one_rank_norm(runtime, grids, tmp_path, zero):
    """The first step's global gradient norm on cp 2 x dp 2 equals one rank's (fp32, 1e-6 relative:
    sums regrouped), with ZeRO-1's shards spread over dp x cp counted once each and, without ZeRO,
    the dp x cp replicas once in all. The losses cannot show a wrong norm: clipping scales the
    gradients, and Adam's update does not change with their scale."""
    sets = (*TINY, "train.steps=1", f"optim.zero={zero}")
    grids.grid(1, 1, 1)
    ref = None
    if runtime.rank == 0:
        ref = grid_trainer(grids, 1, 1, 1, (*sets, f"run.dir={tmp_path / 'solo'}")).step()[2]
    settle(runtime.comm)
    ref = runtime.comm.bcast(ref, root=0)
    sub = grids.runtime(4)
    run_dir = sub.comm.bcast(str(tmp_path / "cp"), root=0)
    norm = None
    if grids.trains(4):
        trainer = grid_trainer(grids, 1, 1, 2, (*sets, "parallel.cp=2", f"run.dir={run_dir}"))
        norm = trainer.step()[2]
        trainer.dp.wait_params()
    else:
        grids.stand_by(grids.grid(1, 1, 2, "tp-dp-pp", 2), 1)
    settle(runtime.comm)
    norm = next(x for x in runtime.comm.allgather(norm) if x is not None)
    assert norm == pytest.approx(ref, rel=1e-6), (norm, ref)
