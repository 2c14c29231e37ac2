"""Maps the root folders onto the `kvfuse` namespace.

`engine/`, `kernels/` and `integrations/` sit at the repository root (fixed by the product brief) but install
as `kvfuse.engine`, `kvfuse.kernels` and `kvfuse.integrations`, never as bare top-level packages. Every
sub-package found under those folders is mapped, so adding a folder with an `__init__.py` needs no edit here.
"""
from setuptools import find_packages, setup

ROOTS = {"kvfuse": "kvfuse", "kvfuse.engine": "engine", "kvfuse.kernels": "kernels",
         "kvfuse.integrations": "integrations"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
