"""gridlm: MPI-launched 3D-parallel GPT training for supercomputers."""

from setuptools import Extension, find_packages, setup

setup(
    name="gridlm",
    version="0.1.0",
    description="MPI-launched tensor x pipeline x data parallel GPT training on PyTorch",
    packages=find_packages(include=["app", "app.*", "launch", "launch.*", "postprocess", "postprocess.*"]),
    python_requires=">=3.9",
    install_requires=["torch", "numpy", "pyyaml", "mpi4py", "h5py", "tokenizers"],
    extras_require={"test": ["pytest", "pytest-mpi", "pytest-timeout"]},
    # The v2 checkpoint checksum's inner loop (app/checkpoint/slabs.py falls back to NumPy without it).
    ext_modules=[Extension("app.checkpoint._checksum", ["app/checkpoint/_checksum.c"], extra_compile_args=["-O3"])],
    entry_points={"console_scripts": ["gridlm=app.__main__:main"]},
)
