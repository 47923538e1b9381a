#!/usr/bin/env python3
"""The Debian packages the Python side of the benches and fixture generators imports (diffusers' own code on Debian
12's Python: scripts/diffusers_env.py, bench/diffusers_pipeline_time.py, tests/data/*/make_cases.py), checked up
front so that a fresh machine learns in the first line what to install instead of dying deep inside diffusers with
`ModuleNotFoundError: No module named 'packaging'`. Standard library only: it runs before anything it checks.

  python3 scripts/python_deps.py           # exit 0 when every package is importable, else the apt-get line (exit 1)
  python3 scripts/python_deps.py --list    # the Debian package names, one a line (scripts/bench-deps.sh reads them)
"""
import importlib.util
import sys

# (module diffusers' import path or ours imports, the Debian 12 package that provides it)
DIFFUSERS_PACKAGES = [
    ("torch", "python3-torch"),
    ("numpy", "python3-numpy"),
    ("packaging", "python3-packaging"),
    ("filelock", "python3-filelock"),
    ("requests", "python3-requests"),
    ("regex", "python3-regex"),
    ("PIL", "python3-pil"),
    ("tqdm", "python3-tqdm"),
    ("httpx", "python3-httpx"),
    ("yaml", "python3-yaml"),
]

# What scripts/diffusers_env.py itself imports (a generator that never imports diffusers needs only these).
TORCH_PACKAGES = DIFFUSERS_PACKAGES[:2]


def missing(packages=DIFFUSERS_PACKAGES):
    """The Debian packages of the modules that cannot be found, in the list's order."""
    gone = []
    for module, package in packages:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module hidden as None in sys.modules, or a broken parent
            found = False
        if not found:
            gone.append(package)
    return gone


def require(packages=DIFFUSERS_PACKAGES):
    """Exits (status 1) with one line naming the apt-get command when a package is missing."""
    gone = missing(packages)
    if gone:
        sys.exit("missing Python packages: apt-get install %s (scripts/bench-deps.sh installs every package the "
                 "benches' Python needs)" % " ".join(gone))


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        print("\n".join(package for _, package in DIFFUSERS_PACKAGES))
    elif sys.argv[1:]:
        sys.exit("usage: python3 scripts/python_deps.py [--list]")
    else:
        require()
        print("python_deps: all %d packages present" % len(DIFFUSERS_PACKAGES))
