"""Sessions for the GACT monorepo.

``nox -s tests`` runs every package's test suite (``tests(kernels)``, ``tests(policy)``,
``tests(runtime)``, ``tests(examples)``), each in its own virtual environment. ``nox -s demo``
is the main job, ``nox -s slow`` the real-data end-to-end tests, ``nox -s bench`` the benchmarks.

Every session that needs torch installs the CPU build pinned in ``constraints.txt``; a bare
``torch`` requirement in a fresh environment would pull several GB of CUDA wheels. Set
``GACT_TORCH_SPEC`` (for example ``torch==2.11.0``) to test against another torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PACKAGES = {
    "kernels": ROOT / "packages" / "gact-kernels",
    "policy": ROOT / "packages" / "gact-policy",
    "runtime": ROOT / "packages" / "gact-runtime",
}
PACKAGE_IDS = ["kernels", "policy", "runtime", "examples"]
BENCH_IDS = ["kernels", "policy", "runtime", "examples"]
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
DATA = Path(os.environ.get("GACT_DATA", ROOT.parent / "shared" / "data"))


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def _install_torch(session: nox.Session) -> None:
    spec = os.environ.get("GACT_TORCH_SPEC")
    if spec:
        session.install(spec)
    else:
        session.install(*CONSTRAINTS, "torch")


def _install_stack(session: nox.Session, *extra: str, cuda: bool | None = None) -> None:
    """Install torch, then the three packages (and ``extra``) into the session.

    ``cuda=False`` builds gact-kernels without its CUDA module (saves minutes where there is no
    GPU to run it); ``None`` leaves the choice to CMake (built whenever nvcc is found).
    """
    _install_torch(session)
    env = {}
    if cuda is False:
        env["SKBUILD_CMAKE_DEFINE"] = "GACT_KERNELS_CUDA=OFF"
    session.install(
        *CONSTRAINTS,
        str(PACKAGES["kernels"]),
        str(PACKAGES["policy"]),
        f"{PACKAGES['runtime']}[test]",
        *extra,
        env=env,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Static checks (ruff) over the whole tree."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
@nox.parametrize("package", PACKAGE_IDS, ids=PACKAGE_IDS)
def tests(session: nox.Session, package: str) -> None:
    """One package's test suite, installed on its own (policy runs without torch)."""
    if package == "policy":
        session.install(f"{PACKAGES['policy']}[test]")
        session.run("pytest", str(PACKAGES["policy"] / "tests"), *session.posargs)
        return
    if package == "kernels":
        # Always the full build: CI has nvcc, so the CUDA sources are compiled here.
        _install_torch(session)
        session.install(*CONSTRAINTS, f"{PACKAGES['kernels']}[test]")
        session.run("pytest", str(PACKAGES["kernels"] / "tests"), *session.posargs)
        return
    cuda = None if _has_gpu() else False
    if package == "runtime":
        _install_stack(session, cuda=cuda)
        session.run("pytest", str(PACKAGES["runtime"] / "tests"), *session.posargs)
        return
    _install_stack(session, "scipy", "scikit-learn", "matplotlib", "tqdm", "pillow", cuda=cuda)
    session.run("pytest", str(ROOT / "examples" / "tests"), *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """Real-data end-to-end tests (MNIST at L2 against fp32); needs ../shared/data."""
    _install_stack(session, "scipy", "tqdm", cuda=None if _has_gpu() else False)
    session.run(
        "pytest",
        "-m",
        "slow",
        str(PACKAGES["runtime"] / "tests"),
        *session.posargs,
        env={"GACT_DATA": str(DATA)},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: fp32 against GACT levels on real data, with a PNG chart."""
    _install_stack(
        session, "scikit-learn", "matplotlib", "tqdm", cuda=None if _has_gpu() else False
    )
    session.run("python", str(ROOT / "examples" / "demo.py"), *session.posargs)


@nox.session
@nox.parametrize("suite", BENCH_IDS, ids=BENCH_IDS)
def bench(session: nox.Session, suite: str) -> None:
    """Benchmarks: kernels, allocator, runtime overhead, and the examples over levels and seeds."""
    if suite == "policy":
        session.install(str(PACKAGES["policy"]))
        session.run(
            "python", str(PACKAGES["policy"] / "benchmarks" / "bench_policy.py"), *session.posargs
        )
        return
    _install_stack(session, "scipy", "matplotlib", "tqdm", "pillow")
    if suite in ("kernels", "runtime"):
        script = {"kernels": "bench_kernels.py", "runtime": "bench_adapt.py"}[suite]
        session.run("python", str(PACKAGES[suite] / "benchmarks" / script), *session.posargs)
        return
    session.run(
        "python", str(ROOT / "examples" / "bench.py"), "--data", str(DATA), *session.posargs
    )
