"""gridlm on one GPU against what a PyTorch user gets elsewhere: step time, TFLOP/s and MFU.

    python benchmarks/gpu_bench.py [--decks gpt_1.3b gpt_2.7b llama_0.84b] [--rounds 3] [--steps 10]
        [--cases gridlm gridlm_unfused gridlm_eager gridlm_cudnn gridlm_offload gridlm_offload_delay hf hf_compile
                 adamw] [--set key=value ...]
        [--out runs/gpu_bench] [--timeout 900]
    python benchmarks/gpu_bench.py --device cpu --tiny --rounds 1     (the whole flow on a CPU, tiny shapes)
    python benchmarks/gpu_bench.py --summary [--out DIR] [the calls' --steps/--set/--tiny/--device]

For every deck of inputs/gpu/ named, in each of --rounds rounds (the cases alternate, so that a
drifting machine moves them alike), each case runs in its own process with its own timeout:

- `gridlm`: `python -m app DECK` for --steps steps; its summary.json gives the step (mean after the
  warm-up), TFLOP/s, MFU and the forward / backward / optimizer times of rank 0 (the deck's
  defaults: on a GPU llama's element-wise chains compiled, app/model/fused.py, and the weight
  gradients' accumulation fused into their GEMMs); `gridlm_unfused` the same with
  train.fuse_grad_accumulation=false (GPUs only: the CPU default); `gridlm_eager` the same with
  run.compile=false; `gridlm_cudnn` with model.attention_kernel=cudnn (cuDNN's fused
  attention instead of the one torch picks; GPUs only, left out with --device cpu);
  `gridlm_offload` with optim.offload=host (the optimizer on the CPU, issue 41's exact offload)
  and `gridlm_offload_delay` with the delayed update too (optim.offload_delay=1), their JSON with
  the host update's own time from the run's log (host_update_s);
- `hf`, `hf_compile`: the Hugging Face model of the same shape (GPT2LMHeadModel for gpt2 decks,
  LlamaForCausalLM for llama; sdpa attention, bf16 autocast over fp32 weights, the deck's
  micro-batches accumulated, torch.optim.AdamW(fused=True)), eager and under torch.compile; the
  step is timed like gridlm's (mean of the steps after 2 warm-up steps, compilation excluded);
- `adamw`: torch.optim.AdamW(fused=True) over fp32 tensors of the deck's parameter count, and a
  copy of them into bf16 (the roofline of gridlm's optimizer step, which also publishes bf16
  parameters).

TFLOP/s and MFU of every case use gridlm's model-FLOP count of the deck (app.metrics.flops, the
Megatron convention) and the device's peak (app.metrics.peaks), so the columns compare. Each case
prints one JSON line (also appended to OUT/results.jsonl, with the setting: --steps, the deck keys
and `git describe --dirty`), and the end a table of the medians over the rounds (counted) with the
device's name, gridlm's dry-run prediction of the case on dgx_h100 beside it, and gridlm's final
loss (cases of one deck that change no numerics agree); then, for each deck with both `gridlm` and
`gridlm_unfused` rows of this setting in OUT/results.jsonl, a "fusion check" line: the two final
losses within 1% (ok, or FAILED and exit 1) and the two step times. `--summary` runs nothing and
prints that table over every row of this setting in OUT/results.jsonl: the rounds of several calls
(gpu_session.sh runs one round a call).
Without a CUDA device (and without --device cpu) it prints one line saying so and exits 2.
A benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DECKS = ["gpt_1.3b", "gpt_2.7b", "llama_0.84b"]
CASES = ["gridlm", "gridlm_unfused", "gridlm_eager", "gridlm_cudnn", "gridlm_offload", "gridlm_offload_delay", "hf",
         "hf_compile", "adamw"]  # fmt: skip
# Left out with --device cpu: no such kernel there (cuDNN); the CPU default already (unfused).
GPU_ONLY = {"gridlm_cudnn", "gridlm_unfused"}
# gridlm's cases and the deck keys each adds.
GRIDLM = {
    "gridlm": [],
    "gridlm_unfused": ["train.fuse_grad_accumulation=false"],  # the gradients added by a pass of their own
    "gridlm_eager": ["run.compile=false"],
    "gridlm_cudnn": ["model.attention_kernel=cudnn"],
    "gridlm_offload": ["optim.offload=host"],
    "gridlm_offload_delay": ["optim.offload=host", "optim.offload_delay=1"],
}
# --tiny: every deck shrunk to seconds on a CPU (the flow, not the numbers).
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab_size=128",
        "model.ffn_hidden=null", "train.global_batch=4", "train.micro_batch=2"]  # fmt: skip
WARMUP = 2  # steps not timed (gridlm's summary skips its own warm-up the same way)


def load(deck: str, sets: list[str]):
    from app.deck import load_deck, resolve_for_world

    return resolve_for_world(load_deck(REPO / "inputs" / "gpu" / f"{deck}.yaml", sets), 1)


def model_flops(deck) -> float:
    from app.metrics.flops import arch_flops_args, gpt_step_flops

    m = deck.model
    return gpt_step_flops(deck.train.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn,
                          **arch_flops_args(m))  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(deck, device):
    """The Hugging Face model of the deck's shape, fp32 weights, sdpa attention."""
    import transformers

    m = deck.model
    if m.spec.hf.model_type == "llama":  # the HF class of the entry's form
        config = transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn, num_hidden_layers=m.layers,
            num_attention_heads=m.heads, num_key_value_heads=m.kv, max_position_embeddings=m.seq_len,
            rope_theta=m.rope_theta, tie_word_embeddings=bool(m.tie_embeddings), attention_bias=False,
        )  # fmt: skip
    else:
        config = transformers.GPT2Config(
            vocab_size=m.vocab_size, n_positions=m.seq_len, n_embd=m.hidden, n_layer=m.layers, n_head=m.heads,
            n_inner=m.ffn, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)


def run_hf(deck, device, steps: int, compile_: bool) -> dict:
    """Train the Hugging Face peer `steps` timed steps (after WARMUP); seconds per step."""
    import torch

    model = hf_model(deck, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if compile_ else model
    tr, m = deck.train, deck.model
    accumulation = tr.global_batch // tr.micro_batch
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if tr.precision != "fp32" else torch.float32

    def step() -> None:
        for _ in range(accumulation):
            x = torch.randint(0, m.vocab_size, (tr.micro_batch, m.seq_len), generator=gen).to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = forward(input_ids=x, labels=x).loss / accumulation
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(WARMUP):
        step()
    _sync(device)
    warm = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return {"step_s": (time.perf_counter() - t) / steps, "warmup_s": warm,
            "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip


def run_adamw(deck, device, steps: int) -> dict:
    """torch.optim.AdamW(fused=True) over the deck's parameter count in fp32, plus a bf16 copy-out."""
    import torch

    from app.plan.estimate import stage_params

    m = deck.model
    n = int(stage_params(m, 1, m.layers, True, True))
    chunk = 1 << 26  # tensors of 64M elements: the kernel's lists, not one huge tensor
    params = [torch.zeros(min(chunk, n - lo), device=device, requires_grad=True) for lo in range(0, n, chunk)]
    for p in params:
        p.grad = torch.rand_like(p)
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step() -> None:
        opt.step()
        torch._foreach_copy_(copies, params)

    for _ in range(WARMUP):
        step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return {"step_s": (time.perf_counter() - t) / steps, "parameters": n}


def keep_log(where: Path, stdout, stderr) -> None:
    """A case's whole output beside its results (appended per round), for a run that failed far away."""
    where.mkdir(parents=True, exist_ok=True)
    text = [t.decode(errors="replace") if isinstance(t, bytes) else (t or "") for t in (stdout, stderr)]
    with (where / "log.txt").open("a") as f:
        f.write(text[0] + text[1])


def run_case(cmd: list[str], where: Path, timeout: float, env: Optional[dict] = None):
    """Run one case's process, its output kept in `where`: (the finished process, None), or (None,
    the row's error) when it timed out or failed."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        keep_log(where, e.stdout, e.stderr)
        return None, {"error": f"timed out after {timeout:.0f} s"}
    keep_log(where, proc.stdout, proc.stderr)
    if proc.returncode != 0:
        return None, {"error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}"}
    return proc, None


def run_gridlm(case: str, deck_name: str, sets: list[str], steps: int, out: Path, timeout: float) -> dict:
    run_dir = out / case / deck_name
    cmd = [sys.executable, "-m", "app", str(REPO / "inputs" / "gpu" / f"{deck_name}.yaml")]
    extra = [*sets, f"train.steps={steps + WARMUP}", f"run.dir={run_dir}", f"run.log_every={steps + WARMUP}"]
    cmd += [a for s in extra for a in ("--set", s)]
    # not a rank of this process's launcher, but keep the site's MCA settings (OMPI_MCA_*)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_")) or k.startswith("OMPI_MCA_")}  # fmt: skip
    proc, error = run_case(cmd, run_dir, timeout, env)
    if proc is None:
        return error
    summary = json.loads((run_dir / "summary.json").read_text())
    timers = summary.get("timers") or {}
    memory = summary.get("memory_bytes_rank0") or {}
    host = re.search(r"gridlm: offloaded update on the host: ([\d.]+) ms a step", proc.stdout)  # offloaded cases
    return {"step_s": summary["step_time_s"], "parameters": summary["parameters"],
            "forward_s": timers.get("forward_s"), "backward_s": timers.get("backward_s"),
            "optimizer_s": timers.get("optimizer_s"), "host_update_s": float(host[1]) / 1e3 if host else None,
            "final_loss": summary.get("final_loss"),
            # Issue 41's table: the peak host RSS (offload's pinned state) and device memory of rank 0.
            "peak_rss_gb": memory["peak_rss"] / 1e9 if "peak_rss" in memory else None,
            "peak_device_gb": memory["peak_device_allocated"] / 1e9 if "peak_device_allocated" in memory else None}  # fmt: skip


def one_case(args: argparse.Namespace) -> int:
    """The --case worker: one peer case in this process, its JSON on stdout."""
    import torch

    device = torch.device(args.device)
    deck = load(args.deck, args.sets)
    if args.case == "adamw":
        result = run_adamw(deck, device, args.steps)
    else:
        result = run_hf(deck, device, args.steps, args.case == "hf_compile")
    print(json.dumps(result))
    return 0


def measure(case: str, deck_name: str, args: argparse.Namespace, sets: list[str]) -> dict:
    if case in GRIDLM:
        return run_gridlm(case, deck_name, [*sets, *GRIDLM[case]], args.steps, args.out, args.timeout)
    cmd = [sys.executable, __file__, "--case", case, "--deck", deck_name, "--device", args.device,
           "--steps", str(args.steps), *(a for s in sets for a in ("--set", s))]  # fmt: skip
    proc, error = run_case(cmd, args.out / case / deck_name, args.timeout)
    if proc is None:
        return error
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict], device_name: str) -> str:
    keys = sorted({(r["deck"], r["case"]) for r in rows}, key=lambda k: (DECKS.index(k[0]) if k[0] in DECKS else 9,
                                                                           CASES.index(k[1])))  # fmt: skip
    lines = [f"device: {device_name}",
             "| deck | case | rounds | step ms | TFLOP/s | MFU | forward / backward / optimizer ms "
             "| predicted ms (dgx_h100) | final loss |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def med(got: list[dict], key: str):
        values = [r[key] for r in got if r.get(key) is not None]
        return statistics.median(values) if values else None

    for deck, case in keys:
        got = [r for r in rows if r["deck"] == deck and r["case"] == case and "error" not in r]
        if not got:
            errors = [r["error"] for r in rows if r["deck"] == deck and r["case"] == case]
            lines.append(f"| {deck} | {case} | 0 | {errors[-1] if errors else 'no result'} | | | | | |")
            continue
        step, tflops, mfu = med(got, "step_s"), med(got, "tflops"), med(got, "mfu")
        phases = [med(got, k) for k in ("forward_s", "backward_s", "optimizer_s")]
        phase = " / ".join(f"{p * 1e3:.1f}" for p in phases) if all(p is not None for p in phases) else ""
        predicted, loss = med(got, "predicted_s"), med(got, "final_loss")  # the loss: same-deck cases agree
        lines.append(f"| {deck} | {case} | {len(got)} | {step * 1e3:.1f} | {tflops:.1f} | "
                     f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {phase} | "
                     f"{'' if predicted is None else f'{predicted * 1e3:.0f}'} | "
                     f"{'' if loss is None else f'{loss:.4f}'} |")  # fmt: skip
    return "\n".join(lines)


def predicted_step(deck) -> float | None:
    """gridlm's dry-run prediction of the deck's step on dgx_h100 (the performance model)."""
    try:
        from app.plan.machine import load_machine
        from app.plan.perf import predict

        return predict(deck, load_machine("dgx_h100")).step_time_s
    except Exception:  # a deck the model cannot predict: the column stays empty
        return None


FUSION_RTOL = 1e-2  # bf16 over 12 steps: another rounding of the weight gradients, not another model


def fusion_check(rows: list[dict]) -> list[str]:
    """One line per deck measured on a GPU with the weight gradients' accumulation fused (`gridlm`,
    the GPU default) and unfused (`gridlm_unfused`): their final losses (the medians) within
    FUSION_RTOL, ok or FAILED, and the step time each way."""
    lines = []
    for deck in dict.fromkeys(r["deck"] for r in rows):
        got = {c: [r for r in rows if r["deck"] == deck and r["case"] == c and r.get("final_loss") is not None]
               for c in ("gridlm", "gridlm_unfused")}  # fmt: skip
        if not all(got.values()):
            continue
        fused, unfused = (statistics.median(r["final_loss"] for r in got[c]) for c in ("gridlm", "gridlm_unfused"))
        f_step, u_step = (statistics.median(r["step_s"] for r in got[c]) for c in ("gridlm", "gridlm_unfused"))
        verdict = "ok" if abs(fused - unfused) <= FUSION_RTOL * abs(unfused) else "FAILED"
        lines.append(f"fusion check {deck}: final loss fused {fused:.4f} vs unfused {unfused:.4f} "
                     f"({verdict}, rtol {FUSION_RTOL:g}); step {f_step * 1e3:.1f} vs {u_step * 1e3:.1f} ms")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decks", nargs="+", default=DECKS, choices=DECKS)
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case (after 2 warm-up steps)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="shrink every deck to seconds (a CPU check of the flow)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_bench")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--summary", action="store_true",
                    help="run nothing: the table of medians over the rows of OUT/results.jsonl of this setting "
                         "(--steps, --set, --tiny, --device and the commit), every call's rounds")  # fmt: skip
    ap.add_argument("--case", choices=[c for c in CASES if c not in GRIDLM], help=argparse.SUPPRESS)  # a peer's worker
    ap.add_argument("--deck", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error(f"--rounds and --steps must be at least 1, not {args.rounds} and {args.steps}")
    if args.case:
        return one_case(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_bench: no CUDA device here (torch {torch.__version__} sees none): run it on a GPU node, "
              "or pass --device cpu --tiny to check the flow on a CPU", file=sys.stderr)  # fmt: skip
        return 2
    from app.metrics.peaks import peak_tflops

    sets = [*(TINY if args.tiny else []), f"run.device={args.device}", *args.sets]
    if args.device == "cpu":
        sets.append("train.precision=fp32")
        args.cases = [c for c in args.cases if c not in GPU_ONLY]
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    # What makes rows of several calls comparable (--summary pools only those), and the code measured.
    setting = {"steps": args.steps, "sets": sets, "commit": commit()}
    if args.summary:
        return summary(results, device_name, setting)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for deck_name in args.decks:
            deck = load(deck_name, sets)
            flops = model_flops(deck)
            peak = peak_tflops(device_name, deck.train.precision)
            for case in args.cases:
                row = {"round": round_, "deck": deck_name, "case": case, "device": device_name, **setting,
                       **measure(case, deck_name, args, sets)}  # fmt: skip
                if "step_s" in row and case != "adamw":
                    row["tflops"] = flops / row["step_s"] / 1e12
                    row["mfu"] = row["tflops"] / peak if peak else None
                    # the case's own keys: the model predicts run.compile, the fused accumulation, offload
                    row["predicted_s"] = (
                        predicted_step(load(deck_name, [*sets, *GRIDLM[case]])) if case in GRIDLM else None
                    )
                elif "step_s" in row:
                    row["tflops"], row["optimizer_s"] = 0.0, row["step_s"]
                print(json.dumps(row), flush=True)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
    print(table(rows, device_name))
    # over the rows of OUT/results.jsonl of this setting: gpu_session.sh measures the two cases in separate calls
    checks = fusion_check(same_setting(results, setting))
    print("\n".join(checks))
    ok = all("error" not in r for r in rows) and not any("FAILED" in line for line in checks)
    return 0 if ok else 1


def commit() -> Optional[str]:
    """The measured code: `git describe --always --dirty` of the repository, or None (no git, no .git)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                             timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def same_setting(results: Path, setting: dict) -> list[dict]:
    """The rows of `results` measured with `setting`'s steps, deck keys and commit (rows of other
    calls into the same --out are left out, not pooled)."""
    lines = results.read_text().splitlines() if results.exists() else []  # no case ran: none yet
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if all(r.get(k) == v for k, v in setting.items())]


def summary(results: Path, device_name: str, setting: dict) -> int:
    """--summary: the table of medians over every round in OUT/results.jsonl of this setting (the rounds
    of several calls, as gpu_session.sh makes them), with the rounds counted, and the fusion checks."""
    rows = same_setting(results, setting)
    if not rows:
        print(f"gpu_bench: no rows of this setting in {results} ({json.dumps(setting)})", file=sys.stderr)
        return 1
    print(table(rows, rows[-1].get("device", device_name)))
    checks = fusion_check(rows)
    print("\n".join(checks))
    return 1 if any("FAILED" in line for line in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
