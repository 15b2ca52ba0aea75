"""Sessions for the GACT monorepo.

``nox -s lint tests`` (the default, and what CI runs through ``.ci/run``) checks style and runs
every suite in its own virtual environment: ``tests(kernels)``, ``tests(policy)``,
``tests(runtime)``, ``tests(examples)`` (with the READMEs' snippets) and
``tests(integrations)`` (transformers, Lightning, PyG), each with its package's doctests.
``nox -s demo`` is the main job, ``nox -s slow`` the real-data end-to-end tests, ``nox -s bench``
the benchmarks.

Every session that needs torch installs the build pinned in ``constraints.txt`` first and passes
the constraints to every later install, so nothing can swap it; ``GACT_TORCH_SPEC`` (for example
``torch==2.11.0``) replaces the pin. ``GACT_DATA`` points the data-driven sessions at the folder
holding ``mnist/``, ``cora/``, ... (default ``../shared/data`` beside the repository).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import tempfile
from functools import cache
from pathlib import Path

import nox
import nox.project

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PACKAGES = {
    "kernels": ROOT / "packages" / "gact-kernels",
    "policy": ROOT / "packages" / "gact-policy",
    "runtime": ROOT / "packages" / "gact-runtime",
}
EXAMPLES = ROOT / "examples"
INTEGRATIONS = PACKAGES["runtime"] / "tests" / "integrations"
TEST_IDS = ["kernels", "policy", "runtime", "examples", "integrations"]
BENCH_SCRIPTS = {
    "kernels": PACKAGES["kernels"] / "benchmarks" / "bench_kernels.py",
    "policy": PACKAGES["policy"] / "benchmarks" / "bench_policy.py",
    "runtime": PACKAGES["runtime"] / "benchmarks" / "bench_saves.py",
    "adapt": PACKAGES["runtime"] / "benchmarks" / "bench_adapt.py",
    "examples": EXAMPLES / "bench.py",
    "speed": EXAMPLES / "speed_bench.py",
    "compare": EXAMPLES / "compare.py",
}
BENCH_IDS = list(BENCH_SCRIPTS)
DATA = Path(os.environ.get("GACT_DATA", ROOT.parent / "shared" / "data"))

# NOTE [one gact-kernels wheel per source state]
# Compiling gact-kernels (C++ always, CUDA whenever nvcc is on PATH) is the slowest install step,
# and every session but lint and tests(policy) needs it. It is built once, with pip's output
# shown, into <nox envdir>/_wheelhouse/<key>/ (.nox/_wheelhouse by default). <key> hashes the
# files that go into the wheel (the package but tests/, benchmarks/, build folders, compiled
# objects), the build options read from the environment, the nvcc found and the Python version;
# every session installs that wheel. So `nox -s lint tests` compiles once, a later run reuses the
# wheel until a source or an option changes, and a clean checkout (CI) always compiles, CUDA
# included where nvcc is. Delete .nox/_wheelhouse to force a rebuild.
_BUILD_ENV = ("SKBUILD_CMAKE_DEFINE", "SKBUILD_CMAKE_ARGS", "CMAKE_ARGS", "CUDAARCHS", "CXX")
_NOT_SOURCES = {"tests", "benchmarks", "build", "dist", "_skbuild", "__pycache__", ".hypothesis"}


@cache
def _kernels_key() -> str:
    digest = hashlib.sha256()
    root = PACKAGES["kernels"]
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_dir() or _NOT_SOURCES & set(rel.parts) or path.suffix in (".so", ".pyc"):
            continue
        digest.update(f"{rel.as_posix()}\0".encode() + path.read_bytes() + b"\0")
    options = [f"{k}={os.environ.get(k, '')}" for k in _BUILD_ENV]
    options += [f"nvcc={shutil.which('nvcc')}", f"python={platform.python_version()}"]
    digest.update("\n".join(options).encode())
    return digest.hexdigest()[:16]


def _kernels_wheel(session: nox.Session) -> Path:
    """The gact-kernels wheel of the current sources and options, built on first use."""
    wheelhouse = Path(session.virtualenv.location).parent / "_wheelhouse"  # in nox's --envdir
    folder = wheelhouse / _kernels_key()
    wheels = sorted(folder.glob("gact_kernels-*.whl"))
    if wheels:
        session.log(f"gact-kernels: reusing {wheels[0]} (same sources and options)")
        return wheels[0]
    cuda = "C++ and CUDA (nvcc found)" if shutil.which("nvcc") else "C++ only (no nvcc on PATH)"
    session.log(f"gact-kernels: compiling the wheel once for all sessions, {cuda}; ~1-3 min")
    wheelhouse.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=wheelhouse))
    pip_wheel = ("python", "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(partial))
    session.run(*pip_wheel, str(PACKAGES["kernels"]))
    with contextlib.suppress(OSError):  # a concurrent nox run may have finished first
        partial.rename(folder)
    return next(folder.glob("gact_kernels-*.whl"))


def _constraints(session: nox.Session) -> tuple[str, str]:
    """``-c FILE``: constraints.txt, with the torch line replaced when GACT_TORCH_SPEC is set."""
    spec = os.environ.get("GACT_TORCH_SPEC")
    if not spec:
        return ("-c", str(ROOT / "constraints.txt"))
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    kept = [line for line in lines if not line.replace(" ", "").startswith("torch=")]
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text("\n".join([*kept, spec, ""]))
    return ("-c", str(path))


def _install_stack(session: nox.Session, *extra: str, runtime_extras: str = "test") -> None:
    """Install torch, then gact-kernels (the shared wheel), gact-policy, gact-runtime and
    ``extra`` into the session, announcing each step."""
    constraints = _constraints(session)
    session.log("installing torch (pinned in constraints.txt or by GACT_TORCH_SPEC) ...")
    session.install(*constraints, "torch")
    wheel = _kernels_wheel(session)
    session.log(f"installing the GACT packages{' and ' + ', '.join(extra) if extra else ''} ...")
    session.install(
        *constraints,
        f"{wheel}[test]",
        str(PACKAGES["policy"]),
        f"{PACKAGES['runtime']}[{runtime_extras}]",
        *extra,
    )


def _pytest(session: nox.Session, tests: Path, package: str, *options: str) -> None:
    """Run a suite plus the doctests of ``package`` (the installed copy, compiled parts included)."""
    session.log(f"running {tests.relative_to(ROOT)} and the doctests of {package} ...")
    session.run(
        "pytest", str(tests), "--doctest-modules", "--pyargs", package, *options, *session.posargs
    )


def _runtime_extras() -> list[str]:
    """The integration extras gact-runtime declares (every optional-dependency group but test)."""
    project = nox.project.load_toml(PACKAGES["runtime"] / "pyproject.toml")["project"]
    return sorted(set(project.get("optional-dependencies", {})) - {"test"})


@nox.session
def lint(session: nox.Session) -> None:
    """Static checks (ruff check, ruff format --check) over the whole tree."""
    session.install(*_constraints(session), "ruff")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
@nox.parametrize("suite", TEST_IDS, ids=TEST_IDS)
def tests(session: nox.Session, suite: str) -> None:
    """One test suite in its own environment (policy runs without torch)."""
    if suite == "policy":
        session.install(*_constraints(session), f"{PACKAGES['policy']}[test]")
        _pytest(session, PACKAGES["policy"] / "tests", "gact_policy")
    elif suite == "kernels":
        _install_stack(session)
        _pytest(session, PACKAGES["kernels"] / "tests", "gact_kernels")
    elif suite == "runtime":
        _install_stack(session)
        _pytest(session, PACKAGES["runtime"] / "tests", "gact", f"--ignore={INTEGRATIONS}")
    elif suite == "examples":
        # transformers: the hf/ scripts; pyg: pyg/cora_fidelity.py
        _install_stack(session, f"{EXAMPLES}[test,transformers]", runtime_extras="test,pyg")
        _pytest(session, EXAMPLES / "tests", "gact_examples")
    else:
        integrations(session)


def integrations(session: nox.Session) -> None:
    """gact-runtime with its integration extras; constraints.txt keeps torch pinned and
    torchvision out (a requirement on it fails the install, naming the requirer)."""
    extras = ",".join(["test", *_runtime_extras()])
    _install_stack(session, runtime_extras=extras)
    session.log(f"with the extras {extras}:")
    _pytest(session, INTEGRATIONS, "gact.integrations")


@nox.session
def slow(session: nox.Session) -> None:
    """Real-data end-to-end tests (MNIST at L2 against fp32); needs GACT_DATA."""
    _install_stack(session, str(EXAMPLES))
    session.log(f"running the slow tests on {DATA} ...")
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
    _install_stack(session, str(EXAMPLES))
    session.log("running examples/demo.py (about 1-3 min of training on 2 idle cores) ...")
    session.run("python", str(EXAMPLES / "demo.py"), *session.posargs)


@nox.session
@nox.parametrize("suite", BENCH_IDS, ids=BENCH_IDS)
def bench(session: nox.Session, suite: str) -> None:
    """Benchmarks: kernels, allocator, cost per save, adaptation cost, the examples over levels
    and seeds, step time of real models, GACT against checkpointing and compile."""
    options: list[str] = []
    if suite == "policy":
        session.install(*_constraints(session), str(PACKAGES["policy"]))
    elif suite == "examples":
        _install_stack(session, str(EXAMPLES))
        options = ["--data", str(DATA)]
    elif suite in ("speed", "compare"):
        _install_stack(session, f"{EXAMPLES}[transformers]")
        options = ["--data", str(DATA)]
        if suite == "compare":
            options += ["--json", "compare.json", "--plot", str(ROOT / "plots" / "compare.png")]
    else:
        _install_stack(session)
    script = BENCH_SCRIPTS[suite]
    session.log(f"running {script.relative_to(ROOT)} ...")
    session.run("python", str(script), *options, *session.posargs)
