"""run.compile: the blocks' element-wise chains as torch.compile kernels equal the eager functions.

Tolerance: inductor generates its own loops and may order a reduction (RMSNorm's mean) or
contract a multiply-add differently from the eager kernels: in fp32 that is a few ulp (measured:
at most 1.2e-6 absolute on gradients up to 12, 2.4e-7 on values up to 4), so values and
gradients must agree to 1e-5 relative and 2e-6 absolute; in bf16 the eager chain
rounds after every op and the fused one once, so they agree to bf16's resolution (2e-2). The
trainings with compile on are in the any-grid = one-rank matrix (tests/test_parallel_equivalence.py).
"""

from __future__ import annotations

import pytest
import torch

from app.model.fused import Kernels


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g)
    return {
        "x": x.to(dtype).requires_grad_(),
        "w": (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).requires_grad_(),
        "q": torch.randn(2, 4, 16, 16, generator=g).to(dtype).requires_grad_(),
        "k": torch.randn(2, 2, 16, 16, generator=g).to(dtype).requires_grad_(),
        "h": torch.randn(2, 16, 2 * 48, generator=g).to(dtype).requires_grad_(),
    }


def _run(kernels: Kernels, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every kernel's outputs, then the gradients of a weighted sum of them w.r.t. every input."""
    outs = [kernels.rms_norm(t["x"], t["w"], 1e-5), *kernels.rotary(t["q"], t["k"], 10000.0, 0), kernels.swiglu(t["h"])]
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o).to(o.dtype) for o in outs]
    total = sum((o * w).float().sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(total, list(t.values()))
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_element_wise_chains_equal_the_eager_ones_values_and_gradients(dtype):
    eager, compiled = Kernels.eager(), Kernels.compiled()
    assert compiled.rms_norm is not eager.rms_norm  # really compiled, not the same functions
    want, got = _run(eager, _inputs(dtype)), _run(compiled, _inputs(dtype))
    names = ["rms_norm", "rotary q", "rotary k", "swiglu", "d x", "d w", "d q", "d k", "d h"]
    tol = {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_a_node_that_cannot_build_the_kernels_gets_a_deck_error_naming_run_compile(tmp_path):
    """run.compile on a node without a working C++ compiler (CXX=/bin/false, a fresh inductor cache
    so that nothing built before is reused): the run ends with exit 2 and one line naming
    run.compile, the kernel and the fix, not inductor's traceback from inside the first step."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    sets = ["model.arch=llama", "model.layers=2", "run.compile=true", "train.steps=1", "checkpoint.at_exit=false",
            "run.resume=none", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s))],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "gridlm: deck error: run.compile = true: torch.compile could not build" in out, out[-3000:]
    assert "set run.compile: false" in out and "Traceback" not in out, out[-3000:]


def test_errors_of_the_computation_pass_through_the_guard():
    """Only torch.compile's own failures become the deck error: an error of the computation (here a
    shape mismatch) is raised as it was."""
    from app.model.fused import _guarded

    def broken(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        _guarded(broken, "broken", True)(torch.ones(2, 2))
