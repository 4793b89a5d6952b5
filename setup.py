"""The installed packages, discovered rather than listed: every package under the repository's
root folders, each installed as ``trtbuild.<folder>`` (DESIGN.md, "Layout and import names").
A root folder is one of ours when it holds an ``__init__.py``; tests/ is the one that is not
installed. pyproject.toml holds everything else."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
NOT_INSTALLED = {"tests"}
ROOTS = sorted(p.name for p in ROOT.iterdir()
               if (p / "__init__.py").is_file() and p.name not in NOT_INSTALLED)

package_dir = {f"trtbuild.{root}": root for root in ROOTS}
packages = [f"trtbuild.{root}" for root in ROOTS]
packages += [f"trtbuild.{root}.{sub}" for root in ROOTS for sub in find_packages(root)]

setup(packages=packages, package_dir=package_dir)
