"""Package discovery: kvlowrank/ as `kvlowrank`, kernels/ as `kvlowrank_kernels`."""
from setuptools import find_packages, setup

_kernels = [("kvlowrank_kernels" + p[len("kernels"):])
            for p in find_packages(include=["kernels", "kernels.*"])]
setup(packages=find_packages(include=["kvlowrank", "kvlowrank.*"]) + _kernels,
      package_dir={"kvlowrank_kernels": "kernels"})
