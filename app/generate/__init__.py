"""Text generation from a checkpoint: the model on this tp grid, a KV cache, greedy or sampled decoding.

`generation_deck` turns the deck a checkpoint carries into the deck of an inference job on N ranks:
tensor parallelism over all of them (tp = N, pp = dp = 1, 1D, no sequence parallelism), the rest of
the model section as trained. `load_model` builds this rank's shard of the model on the meta device,
materialises it on the rank's device and fills it from the checkpoint with parallel HDF5
(`app.checkpoint.io.read_parameters`: the fp32 masters where the file has them, every element
verified against its checksum). `generate` runs the prompt once through the model (prefill), then one
position at a time, each block attending to the keys and values it cached (`GPT.decode`); the logits
of the last position are gathered over tp, so every rank picks the same next token (greedy: argmax;
sampled: the tp group's first rank draws and broadcasts). Decoding runs in fp32.

`python -m app.generate` (its `__main__`) is the command; `python -m app.memorization` uses
`load_model` and `generate` too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from app.errors import DataError, DeckError, LaunchError

if TYPE_CHECKING:
    import torch

    from app.data.tokenizer import AnyTokenizer
    from app.deck import Deck
    from app.model.gpt import GPT
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime

# The inference grid: the model split over every rank by 1D tensor parallelism, nothing else (no
# context or expert parallelism either: a checkpoint reads onto any grid). The attention kernel and the
# communication backend are the device's: a GPU-only kernel (cudnn, flash) or nccl from training changes
# nothing in the result and would not run here (CPU ranks; decoding is fp32, which flash has no kernel for).
INFERENCE_GRID = (
    "parallel.pp=1", "parallel.dp=auto", "parallel.virtual_stages=1", "parallel.stage_layers=null",
    "parallel.tensor=null", "parallel.tensor_order=xyz", "parallel.sequence_parallel=false", "parallel.cp=1",
    "parallel.ep=1", "parallel.backend=auto", "model.attention_kernel=auto",
)  # fmt: skip


def generation_deck(path: Path, world: int, overrides: tuple[str, ...] = ()) -> Deck:
    """The deck of an inference job on `world` ranks from checkpoint `path`'s deck: tp = world,
    the model as trained, then the user's --set `overrides` (run.* keys, e.g. run.device=cpu: checked by
    `check_overrides`)."""
    from app.checkpoint.io import read_header, stored_deck

    header = read_header(path)
    raw = stored_deck(header, path)
    try:
        return _inference_deck(raw, path, world, overrides)
    except DeckError as err:
        if err.key.startswith("parallel.") or err.key.startswith("model."):
            raise LaunchError(
                f"generation splits the model over all {world} ranks by tensor parallelism (tp = {world}), which "
                f"this model cannot take: {err}; {_fewer_ranks(raw, path, world, overrides, err)}"
            ) from None
        raise


def _inference_deck(raw: Any, path: Path, world: int, overrides: tuple[str, ...]) -> Deck:
    from app.deck import build_deck, resolve_for_world

    grid = (f"parallel.tp={world}", *INFERENCE_GRID, "train.global_batch=1", "train.micro_batch=1")
    deck = build_deck(raw, str(path), f"the deck of checkpoint {path}", "generate", (*grid, *overrides))
    return resolve_for_world(deck, world)


def _fewer_ranks(raw: Any, path: Path, world: int, overrides: tuple[str, ...], err: DeckError) -> str:
    """The fix of a world the model cannot split over: the largest rank count that it can, and the
    quantity that limits it (the key of the refusal: model.heads, model.kv_heads, model.vocab_size, ...)."""
    fits = 1
    for ranks in range(min(world - 1, 1024), 1, -1):  # a model splits over a few ranks: no need to try thousands
        try:
            _inference_deck(raw, path, ranks, overrides)
        except DeckError:
            continue
        fits = ranks
        break
    limit = f"{err.key} = {err.value}" if err.key.startswith("model.") else "the model's heads, MLP and vocabulary"
    return f"launch fewer ranks: {fits} (the rank count must divide {limit})"


def check_overrides(overrides: tuple[str, ...], tool: str) -> None:
    """An inference command (`tool`, as its messages name it) takes only run.* --set keys."""
    for given in overrides:
        if not given.startswith("run."):
            raise DeckError(
                "--set", given, f"{tool} takes the model from the checkpoint and runs tp over every rank; "
                "only run.* keys can be set (e.g. run.device=cpu)"
            )  # fmt: skip


def run_on_checkpoint(
    args: argparse.Namespace,
    body: Callable[[Deck, Runtime, ProcessGrid, argparse.Namespace, Path], None],
    tool: str = "generation",
    check: Callable[[], None] = lambda: None,
) -> int:
    """An inference command's job (`app.job.run_job`) on the checkpoint `args.checkpoint` (a file,
    or a directory's latest) with the run.* `args.overrides`: the deck is `generation_deck`'s, and
    `body` gets the command line and the checkpoint's path too. Before the checkpoint is looked for,
    the overrides are checked (messages naming `tool`) and then the command's own `check`. The exit
    status."""
    from app.checkpoint.store import TOOL_PICK, named_checkpoint
    from app.job import run_job

    given, chosen = args.checkpoint, []

    def load(world: int) -> Deck:  # raised alike on every rank: run_job prints it once, exit 2 everywhere
        check_overrides(tuple(args.overrides), tool)
        check()
        missing = "no such file; give a checkpoint file (.h5) or directory"
        chosen.append(named_checkpoint(given, f"checkpoint {given}", missing, TOOL_PICK))
        return generation_deck(chosen[-1], world, tuple(args.overrides))

    return run_job(load, lambda deck, runtime, grid: body(deck, runtime, grid, args, chosen[-1]))


def load_model(deck: Deck, runtime: Runtime, grid: ProcessGrid, path: Path) -> tuple[GPT, dict[str, Any]]:
    """This rank's shard of the checkpoint's model on the inference grid, in eval mode (fp32), and
    the checkpoint's header."""
    from app.checkpoint.io import read_parameters
    from app.model.gpt import GPT
    from app.tensor_parallel.mappings import TensorParallel

    model = GPT(deck.model, seed=0, device="meta", tp=TensorParallel.from_grid(grid))  # shapes only: no init
    metas = {name: p.meta for name, p in model.named_parameters()}  # type: ignore[attr-defined]
    model.to_empty(device=runtime.device)  # new parameters: tagged again, for read_parameters to fill
    for name, p in model.named_parameters():
        p.meta = metas[name]  # type: ignore[attr-defined]
    header = read_parameters(path, model, runtime, grid.coords["tp"], grid.coords["dp"])
    return model.eval(), header


def default_tokenizer(deck: Deck) -> Optional[AnyTokenizer]:
    """The tokenizer of the run's training data, as its token file's metadata names it (the first
    file of a blend), where that file and tokenizer are still readable (the tokenizer.json at its
    recorded path, or beside the token file: `training_data.tokenizer_file`); None for synthetic data."""
    from app.data.tokenizer import ByteTokenizer, HFTokenizer
    from app.generate.training_data import tokenizer_file, training_file

    found, _ = training_file(deck.data)
    if found is None:
        return None
    meta = found.meta
    if meta.get("tokenizer") == "huggingface":
        tokenizer_path, other = tokenizer_file(found)
        if tokenizer_path is None and other:
            raise DataError(
                f"{other[0]} is not the tokenizer the training data {found.prefix} was made with (its sha256 "
                f"differs from the token file's, {meta.get('tokenizer_sha256')}); fix: pass --tokenizer with the "
                "tokenizer.json used by prepare"
            )
        return None if tokenizer_path is None else HFTokenizer(tokenizer_path, eos_id=int(meta["eos"]))
    # No `tokenizer` key (a file written by other tools): unknown, not bytes; text needs --tokenizer.
    return ByteTokenizer() if meta.get("tokenizer") == "byte" else None


def resolve_tokenizer(
    spec: Optional[str], deck: Deck, eos: Optional[str] = None, any_tokenizer: bool = False
) -> Optional[AnyTokenizer]:
    """--tokenizer byte|PATH (with --eos TOKEN, its end-of-document token), else the training data's
    (`default_tokenizer`); checked against the model's vocabulary and, unless `any_tokenizer`
    (--any-tokenizer), against the tokenizer the training data names (`training_data.check_tokenizer`)."""
    from app.data.tokenizer import HFTokenizer, load_tokenizer
    from app.generate.training_data import check_tokenizer, recorded_eos, training_file

    if spec is None and eos is not None:
        raise DataError("--eos names the end-of-document token of a --tokenizer PATH; fix: pass --tokenizer too")
    found = training_file(deck.data)[0] if spec is not None else None
    # The training data's tokenizer.json given again: its recorded end of document, as the default takes
    # (prepare's --eos may name a token of no usual name, or one beside a usual name).
    eos_id = recorded_eos(spec, found) if spec is not None and eos is None else None
    tokenizer: Optional[AnyTokenizer]
    if spec is None:
        tokenizer = default_tokenizer(deck)
    else:
        tokenizer = load_tokenizer(spec, eos) if eos_id is None else HFTokenizer(spec, eos_id=eos_id)
    if tokenizer is not None and tokenizer.vocab_size > deck.model.vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size:,} ids but the model's vocabulary is "
            f"{deck.model.vocab_size:,}: it is not this model's tokenizer; pass the one it was trained with "
            "(--tokenizer byte|PATH) or --prompt-ids"
        )
    if tokenizer is not None and spec is not None and not any_tokenizer:
        check_tokenizer(tokenizer, spec, found)
    return tokenizer


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature None or 0), or drawn from
    softmax(logits / temperature) over the top_k most likely (all when top_k is None)."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return not self.temperature


def check_lengths(deck: Deck, prompt_tokens: int, max_new: int) -> None:
    """A model with learned positions (gpt2) has positions 0 .. seq_len - 1 only (rotary ones extend);
    the last new token is not run through the model, so a prompt and its new tokens take one fewer."""
    if prompt_tokens < 1:
        raise DataError("the prompt is empty; give at least one token (--prompt TEXT or --prompt-ids 1,2,3)")
    seq = deck.model.seq_len
    if deck.model.spec.learned_positions and prompt_tokens + max_new - 1 > seq:
        fix = (
            f"--max-new-tokens {seq - prompt_tokens + 1}"
            if prompt_tokens <= seq
            else f"a prompt of at most {seq} tokens"
        )
        raise DataError(
            f"a prompt of {prompt_tokens} tokens and {max_new} new ones need {prompt_tokens + max_new - 1} positions; "
            f"this {deck.model.arch} model learned {seq} (model.seq_len); fix: {fix}"
        )


def kv_cache_bytes(deck: Deck, tp: int, batch: int, positions: int) -> int:
    """Bytes of this rank's KV cache (`generate` allocates it whole for every position up front): keys
    and values of its kv heads (kv / tp) in every block, fp32 as decoding runs."""
    m = deck.model
    return 2 * m.layers * batch * (m.kv // tp) * (m.hidden // m.heads) * positions * 4


def check_cache_memory(deck: Deck, tp: int, prompt_tokens: int, max_new: int, free: Optional[int], where: str) -> None:
    """A KV cache above the memory this rank has `free` (its GPU's, or its share of the node's host
    memory) is a DataError naming the largest --max-new-tokens that fits, not the allocator's
    traceback (a rotary model has no position limit: --max-new-tokens 1000000000 asked for 128 GB)."""
    if free is None:
        return
    positions = prompt_tokens + max_new
    need = kv_cache_bytes(deck, tp, 1, positions)
    if need <= free:
        return
    fits = free // max(1, kv_cache_bytes(deck, tp, 1, 1)) - prompt_tokens
    fix = f"--max-new-tokens {fits}" if fits >= 1 else "a shorter prompt, or more ranks (tp splits the cache)"
    raise DataError(
        f"the KV cache of {positions:,} positions ({prompt_tokens} prompt + {max_new:,} new) needs "
        f"{need / 2**30:.2f} GiB on each rank, but {where} has {free / 2**30:.2f} GiB free; fix: {fix}"
    )


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    import torch

    if sampling.greedy:
        return logits.argmax(dim=-1)
    device = logits.device
    logits = logits.cpu()
    # Shifted so that the largest is 0 first: a tiny temperature then gives -inf, never inf - inf (nan).
    # At least float32's smallest normal: a temperature that rounds to 0 in float32 (below ~1e-45) would
    # divide 0 by 0 (nan); any temperature that small is greedy anyway.
    divisor = max(float(sampling.temperature or 1.0), torch.finfo(torch.float32).tiny)
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / divisor
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(device)


def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new: int,
    sampling: Sampling = Sampling(),
    eos: Optional[int] = None,
) -> torch.Tensor:
    """The new tokens (B, N <= max_new) after prompts (B, P) of equal length, on every rank of the
    tp group alike. With `eos`, stops once every sequence has produced it (the EOS is kept)."""
    import torch
    import torch.distributed as dist

    from app.model.gpt import KVCache

    tp = model.tp
    generator = torch.Generator().manual_seed(sampling.seed)
    cache = KVCache(prompt.shape[1] + max_new)
    logits = model.decode(prompt, cache, 0)
    new: list[torch.Tensor] = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for t in range(max_new):
        token = _pick(logits, sampling, generator)
        if not sampling.greedy and tp.size > 1:  # one draw for the tp group (greedy agrees by itself)
            dist.broadcast(token, src=dist.get_global_rank(tp.group, 0), group=tp.group)
        new.append(token)
        if eos is not None:
            done |= token == eos
            if bool(done.all()):
                break
        if t + 1 < max_new:
            logits = model.decode(token[:, None], cache, prompt.shape[1] + t)
    if not new:
        return prompt.new_empty(prompt.shape[0], 0)
    return torch.stack(new, dim=1)


def result_line(record: dict[str, Any]) -> str:
    """The --json line: one JSON object."""
    return json.dumps(record, ensure_ascii=False)
