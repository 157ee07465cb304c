"""Packaging glue: the design card keeps Triton kernels in the top-level ``kernels/`` folder and C++/CUDA sources in
``csrc/``; they ship as the subpackage ``splitz_fast.kernels`` (so that no top-level ``kernels`` package collides with
other installs) and, for non-editable installs, as ``splitz_fast/kernels/csrc`` (the native kernels are compiled from
these sources on first use: splitz_fast/kernels/native.py)."""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NATIVE_SOURCE_SUFFIXES = {".h", ".cpp", ".cu"}


class BuildPyWithNativeSources(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "splitz_fast" / "kernels" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in Path(__file__).resolve().parent.joinpath("csrc").iterdir():
            if source.suffix in NATIVE_SOURCE_SUFFIXES:
                shutil.copy2(source, target / source.name)


setup(
    packages=[*find_packages(include=["splitz_fast", "splitz_fast.*"]), "splitz_fast.kernels"],
    package_dir={"splitz_fast": "splitz_fast", "splitz_fast.kernels": "kernels"},
    cmdclass={"build_py": BuildPyWithNativeSources},
)
