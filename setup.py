"""pip's build step beyond pyproject.toml: ``build_native`` compiles the project's C libraries
(``mooncake/native_build.py``) into ``mooncake/_native/`` -- in the source tree for an editable
install (``pip install -e .``), in the wheel otherwise -- with the flags the run-time build uses,
so that serving needs no compiler. Where one cannot be built here the install goes on: it is
built on first use, or its fallback runs (a warning says which).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent


def _native_build():
    """``mooncake/native_build.py`` (standard library only), without importing the package."""
    spec = importlib.util.spec_from_file_location("_mooncake_native_build", ROOT / "mooncake" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class BuildNative(Command):
    description = "compile mooncake's C libraries into mooncake/_native"
    user_options = [("build-lib=", "b", "directory holding the built package")]

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False  # set by setuptools for an editable install: build in place
        self.outputs = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def run(self) -> None:
        package = ROOT / "mooncake" if self.editable_mode else Path(self.build_lib) / "mooncake"
        self.outputs = [str(p) for p in _native_build().build_all(package / "_native")]

    def get_outputs(self) -> list:
        return [] if self.editable_mode else self.outputs  # in place: found through the source tree


class Build(build):
    sub_commands = [*build.sub_commands, ("build_native", None)]


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel holds machine code: tag it for this platform
        return True


setup(cmdclass={"build": Build, "build_native": BuildNative}, distclass=BinaryDistribution)
