"""Memory per device for each training strategy, before anything loads (`keel plan`).

plan = plan_run(cfg, model_dir, devices=detect_devices(gpus=8, memory="24GiB"))
plan.recommendation            # the cheapest option that fits, or None
decide(plan)                   # what `keel train` should do: a strategy, or a refusal
"""

from keel.plan.devices import DeviceSpec, detect_devices, devices_for_run
from keel.plan.estimate import Breakdown, Option, Workload
from keel.plan.planner import DoesNotFit, Plan, plan_run
from keel.plan.report import (
    Decision,
    advice,
    decide,
    lighter,
    refusal,
    summary,
    table,
    to_json,
)

__all__ = [
    "Breakdown",
    "Decision",
    "DeviceSpec",
    "DoesNotFit",
    "Option",
    "Plan",
    "Workload",
    "advice",
    "decide",
    "detect_devices",
    "devices_for_run",
    "lighter",
    "plan_run",
    "refusal",
    "summary",
    "table",
    "to_json",
]
