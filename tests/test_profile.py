"""run.profile: a few steps under torch.profiler, summarised by kind and kernel in <run.dir>/profile.txt."""

from __future__ import annotations

import re

from app.metrics.profile import OTHER, Kernel, kind_of, summarise
from conftest import run_app

# Kernel names as an H200 profile shows them (torch 2.11, CUDA 13), and CPU operators.
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "gemm",
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false>>": "attention",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "Memcpy DtoH (Device -> Pinned)": "copy",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": OTHER,
    "triton_poi_fused_mul_silu_0": OTHER,
    "aten::addmm": "gemm",
    "aten::native_layer_norm": OTHER,
}


def test_kernels_are_sorted_into_kinds_by_name():
    assert {name: kind_of(name) for name in NAMES} == NAMES


def test_the_summary_gives_each_kind_and_kernel_per_step():
    """Two steps of made-up kernels: times and counts are divided by the steps, shares sum to 1."""
    kernels = [Kernel("aten::mm", 40, 0.030), Kernel("aten::gelu", 8, 0.008), Kernel("aten::_foreach_add_", 2, 0.002)]
    text = summarise(kernels, steps=2, device="cpu")
    assert text.startswith("gridlm profile: 2 step(s) on cpu; per step: 25 operators, 20.00 ms of self CPU time")
    assert "| gemm | 15.000 | 75.0% | 20 |" in text
    assert f"| {OTHER} | 4.000 | 20.0% | 4 |" in text and "| optimizer | 1.000 | 5.0% | 1 |" in text
    assert "| `aten::mm` | gemm | 15.000 | 20 | 750.0 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["aten::mm", "aten::gelu", "aten::_foreach_add_"]  # by time
    assert "Host:" not in text
    # On a GPU, the host's operators follow (here: as if these ran on the host beside CUDA kernels).
    gpu = summarise([Kernel("sm90_xmma_gemm_bf16", 40, 0.030)], steps=2, device="cuda", host=kernels)
    assert gpu.startswith("gridlm profile: 2 step(s) on cuda; per step: 20 kernels, 15.00 ms of device time")
    assert "Host: 25 ATen operators per step, 20.00 ms of self CPU time per step" in gpu
    assert "| `aten::gelu` | 4.000 | 4 |" in gpu


def test_a_profiled_run_counts_the_gemms_the_model_launches(tmp_path):
    """gpt_tiny on one CPU rank, 2 steps profiled after 1 warm-up step: the matrix products per step
    are what the model launches, 4 micro-batches x (4 layers x 4 Linears x 3 products, forward and
    the two gradients, + the tied head's 3), and rank 0 says where the profile went."""
    run = tmp_path / "run"
    done = run_app(1, "inputs/gpt_tiny.yaml", "--set", "train.steps=4", "--set", "run.profile=2",
                   "--set", "run.timing_warmup=1", "--set", f"run.dir={run}", "--set", "checkpoint.at_exit=false")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gridlm: profile of 2 step(s) written to {run / 'profile.txt'}" in done.stdout
    text = (run / "profile.txt").read_text()
    print(text[:1500])
    assert text.startswith("gridlm profile: 2 step(s) on cpu")
    calls = {
        m[1]: float(m[2]) for m in re.finditer(r"^\| `(aten::\w+)` \| \w[^|]* \| [\d.]+ \| ([\d.]+) \|", text, re.M)
    }
    assert calls.get("aten::mm", 0) + calls.get("aten::addmm", 0) == 4 * (4 * 4 * 3 + 3), calls


def test_a_fresh_run_leaves_no_earlier_profile_and_says_when_it_profiled_no_step(tmp_path):
    """Found in review: a fresh run in a used run.dir kept the earlier run's profile.txt, which reads as
    its own (metrics.jsonl and TensorBoard start afresh); and run.profile with no step past
    run.timing_warmup wrote nothing without a word."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile.txt").write_text("gridlm profile: an earlier run's\n")
    done = run_app(1, "inputs/gpt_tiny.yaml", "--set", "train.steps=2", "--set", "run.profile=2",
                   "--set", "run.timing_warmup=2", "--set", f"run.dir={run}", "--set", "checkpoint.at_exit=false",
                   "--set", "model.layers=1")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (run / "profile.txt").exists()
    assert (
        "gridlm: warning: run.profile = 2: no step profiled, this job timed 2 step(s) and profiling starts after "
        "run.timing_warmup = 2; run more steps or lower run.timing_warmup" in done.stdout
    ), done.stdout
