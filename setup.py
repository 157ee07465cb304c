"""Packaging glue: the design card keeps Triton kernels in the top-level ``kernels/`` folder; they ship as the
subpackage ``splitz_fast.kernels`` so that no top-level ``kernels`` package collides with other installs."""
from setuptools import setup

setup(
    packages=["splitz_fast", "splitz_fast.kernels"],
    package_dir={"splitz_fast": "splitz_fast", "splitz_fast.kernels": "kernels"},
)
