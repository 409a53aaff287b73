"""keel doctor's judgements, one at a time: what is a problem, what is a note, the exit code."""

import json
import shutil
from collections import namedtuple

import keel.distributed.process_group as process_group
from keel import doctor
from keel.distributed.smoke import _failure_reason
from keel.doctor import machine, packages

Usage = namedtuple("Usage", "total used free")

TORCHRUN_REPORT = """Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 12)
"""


def test_failure_reason_names_the_first_rank_that_failed_and_what_it_said():
    err = "keel-smoke: rank 1: check 5 (fsdp2 step) failed: AssertionError: x\n" + TORCHRUN_REPORT
    reason = _failure_reason(err, 1, timed_out=False, timeout_s=40)
    assert reason == (
        "torchrun exited with code 1; first failure: rank 1 exited with code 1; "
        "rank 1: check 5 (fsdp2 step) failed: AssertionError: x"
    )
    assert _failure_reason("", None, timed_out=True, timeout_s=40).startswith(
        "timed out after 40 s"
    )


def test_small_dev_shm_is_a_problem_only_with_several_gpus(monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(64 * 2**20, 0, 64 * 2**20))
    on_cpu, on_gpus = doctor.Report(), doctor.Report()
    machine.shared_memory(on_cpu, gpus=0)
    machine.shared_memory(on_gpus, gpus=2)
    assert on_cpu.problems == [] and "64 MiB" in on_cpu.notes[0]
    assert on_gpus.notes == [] and "--shm-size" in on_gpus.problems[0]


def test_a_process_group_without_a_cpu_backend_is_a_problem(monkeypatch):
    monkeypatch.setattr(
        process_group, "backend_for", lambda device_type: "gloo" if device_type == "cpu" else "nccl"
    )
    report = doctor.Report()
    machine._check_keel_backend(report)
    assert len(report.problems) == 1
    assert "'nccl'" in report.problems[0] and "No backend type associated" in report.problems[0]


def test_keel_s_own_backends_pass():
    report = doctor.Report()
    machine._check_keel_backend(report)
    assert report.problems == []


def test_a_dependency_outside_keel_s_range_is_a_problem(monkeypatch):
    real = packages._version
    monkeypatch.setattr(
        packages, "_version", lambda name: "4.57.1" if name == "transformers" else real(name)
    )
    report = doctor.Report()
    packages.check_requirements(report)
    assert len(report.problems) == 1
    assert report.problems[0].startswith("transformers 4.57.1 is installed, but keel needs")
    assert "transformers>=5.0,<6" in report.problems[0] and "pip install" in report.problems[0]


def test_a_dependency_that_does_not_import_is_a_problem(monkeypatch, tmp_path):
    (tmp_path / "broken_peft.py").write_text("from transformers import not_a_real_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(packages, "IMPORTS", {"peft": "broken_peft"})
    monkeypatch.setattr(packages, "OPTIONAL_IMPORTS", {})
    report = doctor.Report(versions={"torch": "2", "transformers": "5", "peft": "0.21"})
    packages.check_imports(report)
    assert len(report.problems) == 1
    assert (
        "`import broken_peft` fails (torch 2, transformers 5, peft 0.21): ImportError"
        in report.problems[0]
    )


def test_omp_num_threads_1_is_a_note(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = doctor.Report()
    machine.environment_notes(report)
    assert report.problems == [] and "OMP_NUM_THREADS=1" in report.notes[0]


def test_exit_code_is_1_with_a_problem_and_stdout_is_one_json_document(monkeypatch, capsys):
    def broken(**kwargs):
        print("a library talking on stdout")  # must not corrupt the JSON
        return doctor.Report(
            problems=["something broke"],
            smoke_test={"ok": False, "seconds": 0.0, "detail": "not run"},
        )

    monkeypatch.setattr(doctor, "diagnose", broken)
    assert doctor.run_doctor(as_json=True, cpu_bf16_speedup=lambda: (1.0, 1.0)) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["problems"] == ["something broke"]
    assert "a library talking on stdout" in out.err


def test_a_known_bad_pair_is_a_problem_with_its_reason(monkeypatch):
    """peft 0.17 imports transformers.HybridCache, gone in transformers 5 (peft#3333)."""
    imported = []
    monkeypatch.setattr(packages, "_import_error", lambda module: imported.append(module))
    monkeypatch.setattr(packages, "OPTIONAL_IMPORTS", {})
    report = doctor.Report(versions={"torch": "2.13.0", "transformers": "5.2.0", "peft": "0.17.1"})
    packages.check_imports(report)
    assert report.problems == [
        "peft 0.17.1 with transformers 5.2.0 does not work: peft < 0.18 imports "
        "transformers.HybridCache, which transformers 5 removed, so `import peft` raises "
        "ImportError (huggingface/peft#3333); pip install 'peft>=0.18'"
    ]
    assert "peft" not in imported  # its import error would say the same, less clearly
    fine = doctor.Report(versions={"torch": "2.13.0", "transformers": "5.2.0", "peft": "0.18.0"})
    packages.check_imports(fine)
    assert fine.problems == []
