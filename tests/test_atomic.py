"""textrl.run.atomic: a file or folder is the old one or the new one; nothing temporary is left."""

from __future__ import annotations

import json
import os

import pytest

from textrl.run import atomic


class Boom(Exception):
    pass


def test_a_file_is_written_and_replaced_with_nothing_left_beside_it(tmp_path):
    path = tmp_path / "record.json"
    atomic.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    atomic.write_text(path, "new\n")
    atomic.write_bytes(tmp_path / "raw.bin", b"\x00\x01")
    assert path.read_text() == "new\n" and (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.bin", "record.json"]


def test_a_failed_file_write_keeps_the_old_file_and_removes_the_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text("old\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_an_unserialisable_object_leaves_the_old_file(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("{}")
    with pytest.raises(TypeError):
        atomic.write_json(path, {"x": object()})
    assert path.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_temporary_file_name_is_recognised(tmp_path, monkeypatch):
    seen = []
    real = atomic.os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: seen.append(os.path.basename(src)) or real(src, dst))
    atomic.write_text(tmp_path / "bench_run.json", "{}")
    assert atomic.is_temporary(seen[0], "bench_run.json")
    assert not atomic.is_temporary("bench_run.json", "bench_run.json")


def test_a_folder_replaces_the_old_one_only_when_whole(tmp_path):
    path = tmp_path / "adapter"

    def write(version):
        def fill(tmp):
            (tmp / "weights").write_text(version)
            (tmp / "sub").mkdir()
        return fill

    atomic.write_folder(path, write("v1"))
    atomic.write_folder(path, write("v2"))
    assert (path / "weights").read_text() == "v2"

    def broken(tmp):
        (tmp / "weights").write_text("half")
        raise Boom

    with pytest.raises(Boom):
        atomic.write_folder(path, broken)
    assert (path / "weights").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no .tmp- or .old- folder


def test_an_interrupted_folder_write_leaves_no_temporary_folder(tmp_path):
    tmp = tmp_path / ".tmp_iter_000001_1"

    def interrupted(folder):
        assert folder == tmp
        (folder / "model.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.write_folder(tmp_path / "iter_000001", interrupted, tmp=tmp)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    path = tmp_path / "merged"
    atomic.write_folder(path, lambda tmp: (tmp / "f").write_text("old"))
    real = atomic.os.replace

    def refuse_the_new(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", refuse_the_new)
    with pytest.raises(OSError, match="cross-device"):
        atomic.write_folder(path, lambda tmp: (tmp / "f").write_text("new"))
    assert (path / "f").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_without_replace_an_existing_folder_is_kept_and_the_rename_fails(tmp_path):
    path = tmp_path / "tiny-model"
    atomic.write_folder(path, lambda tmp: (tmp / "config.json").write_text("first"))
    with pytest.raises(OSError):
        atomic.write_folder(path, lambda tmp: (tmp / "config.json").write_text("second"), replace=False)
    assert (path / "config.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-model"]
