"""gridlm: MPI-launched 3D-parallel GPT training for supercomputers."""

from setuptools import find_packages, setup

setup(
    name="gridlm",
    version="0.1.0",
    description="MPI-launched tensor x pipeline x data parallel GPT training on PyTorch",
    packages=find_packages(include=["app", "app.*", "launch", "launch.*", "postprocess", "postprocess.*"]),
    python_requires=">=3.9",
    install_requires=["torch", "numpy", "pyyaml", "mpi4py", "h5py", "tokenizers"],
    extras_require={"test": ["pytest", "pytest-mpi", "pytest-timeout"]},
    entry_points={"console_scripts": ["gridlm=app.__main__:main"]},
)
