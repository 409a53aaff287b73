"""The doctor's findings and how they read: `Report`, its JSON form and the text report."""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 2**30
OPTIONAL = ("accelerate", "flash_attn", "bitsandbytes", "wandb", "tensorboard")


@dataclass
class Report:
    """Everything `keel doctor` found; `to_json` gives the documented schema."""

    versions: dict[str, str] = field(default_factory=dict)
    not_installed: list[str] = field(default_factory=list)
    devices: list[dict] = field(default_factory=list)
    backends: dict[str, bool] = field(default_factory=dict)
    shm_bytes: int | None = None
    smoke_test: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "versions": self.versions,
            "devices": self.devices,
            "backends": self.backends,
            "smoke_test": self.smoke_test,
            "problems": self.problems,
            "notes": self.notes,
            "not_installed": self.not_installed,
            "shm_bytes": self.shm_bytes,
            "seconds": round(self.seconds, 2),
        }


def _size(size: int | None) -> str:
    return "?" if size is None else f"{size / GIB:.1f} GiB"


def _device_line(d: dict) -> str:
    if d["type"] == "cpu":
        bf16 = "fast" if d["bf16"] else "slow"
        return (
            f"cpu      {d['name']}, {d['cores']} cores, {_size(d['memory_bytes'])} RAM, "
            f"bf16 {bf16} ({d['bf16_gflops']:g} vs fp32 {d['fp32_gflops']:g} GFLOP/s)"
        )
    bf16 = ("yes" if d["bf16_native"] else "emulated") if d["bf16"] else "no"
    return (
        f"cuda:{d['index']}   {d['name']} (sm {d['compute_capability']}), "
        f"{_size(d['memory_bytes'])}, bf16 {bf16}"
    )


def render(report: Report) -> str:
    """The human-readable report."""
    width = max(map(len, [*report.versions, *report.not_installed]))
    lines = ["Versions"]
    lines += [f"  {name:<{width}}  {version}" for name, version in report.versions.items()]
    lines += [
        f"  {name:<{width}}  not installed" + (" (optional)" if name in OPTIONAL else "")
        for name in report.not_installed
    ]
    lines += ["Devices", *(f"  {_device_line(d)}" for d in report.devices)]
    yes = {True: "yes", False: "no"}
    lines += [
        "Backends",
        "  " + ", ".join(f"{name} {yes[ok]}" for name, ok in report.backends.items()),
    ]
    lines += ["Shared memory", f"  /dev/shm {_size(report.shm_bytes)}"]
    smoke = report.smoke_test
    lines += [
        f"Smoke test: {'passed' if smoke['ok'] else 'FAILED'} ({smoke['seconds']:.1f} s)",
        f"  {smoke['detail']}",
    ]
    if smoke.get("stderr_tail"):
        lines += [
            "  workers' stderr (last lines):",
            *(f"    | {line}" for line in smoke["stderr_tail"].splitlines()[-25:]),
        ]
    lines += ["Notes", *(f"  - {n}" for n in report.notes or ["none"])]
    lines += ["Problems", *(f"  - {p}" for p in report.problems or ["none"])]
    verdict = (
        "this machine can train"
        if report.ok
        else f"{len(report.problems)} problem(s): training will not work as is"
    )
    lines += [f"keel doctor: {verdict} (checked in {report.seconds:.1f} s)"]
    return "\n".join(lines)
