"""The C++ kernels build wherever they can (a broken build fails here, not as skips), into a folder keyed
by the sources and toolchain, with the ninja of the interpreter's own environment."""

from __future__ import annotations

import os
import stat

import pytest

from pagedllm.kernels import build_error, build_key, build_search_path, cpu_ops, kernels_expected

SOURCES = {"a.cpp": b"int f() { return 1; }\n", "b.h": b"#pragma once\n"}
FLAGS = ["-O3", "-march=native"]
TOOLCHAIN = {"compiler": "c++", "compiler_version": "g++ 12.2.0", "ninja_version": "1.11.1"}


def test_kernels_build_wherever_they_are_expected_to():
    # The kernel tests skip when cpu_ops() is None; this one does not, so a broken build fails the run.
    reason = kernels_expected()
    if reason is not None:
        pytest.skip(f"the C++ kernels cannot build here: {reason}")
    assert cpu_ops() is not None, f"the C++ kernels failed to build:\n{build_error()}"


def test_checkouts_in_other_folders_build_apart(monkeypatch):
    from pagedllm import kernels

    here, sources = kernels._build_directory("/usr/bin", "c++"), kernels._source_files()
    monkeypatch.setattr(kernels, "_source_files", lambda: sources)  # the same files, copied elsewhere
    monkeypatch.setattr(kernels, "_DIR", "/elsewhere/pagedllm/kernels")
    assert kernels._build_directory("/usr/bin", "c++") != here


def test_build_key_is_stable():
    assert build_key(SOURCES, FLAGS, TOOLCHAIN) == build_key(dict(reversed(SOURCES.items())), FLAGS, TOOLCHAIN)


def test_build_key_changes_with_one_source_byte():
    changed = {**SOURCES, "a.cpp": SOURCES["a.cpp"].replace(b"1", b"2")}
    assert build_key(changed, FLAGS, TOOLCHAIN) != build_key(SOURCES, FLAGS, TOOLCHAIN)


def test_build_key_does_not_let_bytes_move_between_files():
    moved = {"a.cpp": SOURCES["a.cpp"] + b"#", "b.h": SOURCES["b.h"][1:]}
    assert build_key(moved, FLAGS, TOOLCHAIN) != build_key(SOURCES, FLAGS, TOOLCHAIN)


def test_build_key_changes_with_a_flag_or_the_toolchain():
    base = build_key(SOURCES, FLAGS, TOOLCHAIN)
    assert build_key(SOURCES, ["-O2", "-march=native"], TOOLCHAIN) != base
    assert build_key(SOURCES, FLAGS, {**TOOLCHAIN, "ninja_version": "1.10.1"}) != base
    assert build_key(SOURCES, FLAGS, {**TOOLCHAIN, "compiler": "clang++"}) != base


def _bin_dir(tmp_path, with_ninja: bool) -> str:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    if with_ninja:
        ninja = bin_dir / "ninja"
        ninja.write_text("#!/bin/sh\n")
        ninja.chmod(ninja.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


def test_build_path_puts_the_interpreters_ninja_first(tmp_path):
    bin_dir = _bin_dir(tmp_path, with_ninja=True)
    path = os.pathsep.join(["/usr/local/bin", bin_dir, "/usr/bin"])
    assert build_search_path(path, os.path.join(bin_dir, "python")).split(os.pathsep) == [
        bin_dir,
        "/usr/local/bin",
        "/usr/bin",
    ]


def test_build_path_is_unchanged_without_a_ninja_beside_the_interpreter(tmp_path):
    bin_dir = _bin_dir(tmp_path, with_ninja=False)
    path = os.pathsep.join(["/usr/local/bin", "/usr/bin"])
    assert build_search_path(path, os.path.join(bin_dir, "python")) == path


def test_a_build_killed_mid_way_blocks_no_later_build(tmp_path):
    """A builder killed while it holds the folder's lock frees it with its death, and the `lock`
    file torch's load() leaves behind is removed by the next builder, not waited on forever."""
    import fcntl
    import signal
    import subprocess
    import sys

    from pagedllm.kernels import _build_lock

    holder = (
        "import time; from pagedllm.kernels import _build_lock\n"
        f"with _build_lock({str(tmp_path)!r}):\n"
        f"    open({str(tmp_path / 'lock')!r}, 'w').close(); print('held', flush=True); time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        with open(tmp_path / "build.flock") as handle, pytest.raises(BlockingIOError):  # a second builder waits
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert (tmp_path / "lock").exists()  # what a killed torch build leaves
        with _build_lock(str(tmp_path)):
            assert not (tmp_path / "lock").exists()
    finally:
        process.kill()
