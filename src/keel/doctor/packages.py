"""Versions of Python, torch and keel's dependencies; each in range and importable."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as metadata
import platform

import keel
from keel.doctor.report import OPTIONAL, Report

REQUIRED = ("torch", "transformers", "peft", "datasets", "safetensors")
# Imported for real: a pair that does not fit fails at import, whatever the version says.
IMPORTS = {
    "transformers": "transformers",
    "peft": "peft",
    "datasets": "datasets",
    "safetensors": "safetensors.torch",
}
# Optional packages with compiled kernels tied to one torch build: a mismatch is common.
OPTIONAL_IMPORTS = {"flash_attn": "flash_attn", "bitsandbytes": "bitsandbytes"}
# Pairs that both install and then break, with why: (package, versions, other, versions, why).
KNOWN_BAD_PAIRS = [
    (
        "peft",
        "<0.18",
        "transformers",
        ">=5",
        "peft < 0.18 imports transformers.HybridCache, which transformers 5 removed, so "
        "`import peft` raises ImportError (huggingface/peft#3333); pip install 'peft>=0.18'",
    ),
]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_versions(report: Report) -> None:
    """Python, keel's dependencies, CUDA and NCCL, and the optional packages present."""
    import torch

    report.versions["python"] = platform.python_version()
    report.versions["keel"] = keel.__version__
    for name in (*REQUIRED, *OPTIONAL):
        version = torch.__version__ if name == "torch" else _version(name)
        if version is None:
            report.not_installed.append(name)
            if name in REQUIRED:
                report.problems.append(
                    f"{name} is not installed; keel needs it: pip install {name}"
                )
        else:
            report.versions[name] = version
    if torch.version.cuda:
        report.versions["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):  # torch built without NCCL
            nccl = torch.cuda.nccl.version()  # (2, 21, 5); an int in old releases
            report.versions["nccl"] = (
                ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            )
    if getattr(torch.version, "hip", None):
        report.versions["hip"] = torch.version.hip


def check_requirements(report: Report) -> None:
    """Each installed dependency inside the range keel's package metadata declares."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion, Version

        declared = metadata.requires("keel") or []
    except (ImportError, metadata.PackageNotFoundError):
        report.notes.append(
            "keel's declared dependency ranges were not checked "
            "(keel is not pip-installed, or packaging is missing)"
        )
        return
    for line in declared:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev, bench, ...), not needed to train
        installed = _version(req.name)
        # `>=5.0,<6` reads better than SpecifierSet's alphabetical `<6,>=5.0`.
        wanted = req.name + ",".join(
            sorted(map(str, req.specifier), key=lambda spec: spec.startswith("<"))
        )
        if installed is None:
            if req.name not in REQUIRED:  # those are reported by collect_versions
                report.problems.append(
                    f"{req.name} is not installed; keel needs it: pip install '{wanted}'"
                )
            continue
        try:
            fits = req.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            continue
        if not fits:
            report.problems.append(
                f"{req.name} {installed} is installed, but keel needs {wanted} (the versions "
                f"it is built and tested against): pip install '{wanted}'"
            )


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything, not just ImportError
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return None


def _known_bad_pairs(report: Report) -> set[str]:
    """Flag the installed pairs listed in KNOWN_BAD_PAIRS; returns the packages named."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # check_requirements has said so already
        return set()
    flagged = set()
    for name, versions, other, other_versions, why in KNOWN_BAD_PAIRS:
        if name not in report.versions or other not in report.versions:
            continue
        try:
            hits = [
                SpecifierSet(spec).contains(Version(report.versions[n]), prereleases=True)
                for n, spec in ((name, versions), (other, other_versions))
            ]
        except InvalidVersion:
            continue
        if all(hits):
            flagged.add(name)
            report.problems.append(
                f"{name} {report.versions[name]} with {other} {report.versions[other]} "
                f"does not work: {why}"
            )
    return flagged


def check_imports(report: Report) -> None:
    """Import what training imports: a dependency that installs but does not load shows here.

    A pair known to break is reported with its reason instead of its import error.
    """
    broken = _known_bad_pairs(report)
    pair = ", ".join(
        f"{n} {report.versions[n]}"
        for n in ("torch", "transformers", "peft")
        if n in report.versions
    )
    for name, module in IMPORTS.items():
        if name in broken or name in report.not_installed:
            continue
        if error := _import_error(module):
            report.problems.append(
                f"`import {module}` fails ({pair}): {error}; install "
                f"versions that fit together (pip install -U {name})"
            )
    for name, module in OPTIONAL_IMPORTS.items():
        if name not in report.not_installed and (error := _import_error(module)):
            report.notes.append(
                f"{name} {report.versions[name]} is installed but `import "
                f"{module}` fails: {error}; anything that asks for it will "
                f"fail (reinstall it for torch {report.versions['torch']})"
            )
