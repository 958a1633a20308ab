"""Tiny Shakespeare (chapter 10): read, checked against the published sha256, downloaded once."""

import hashlib
import io
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from d2lgpu.data import TINY_SHAKESPEARE_SHA256, tiny_shakespeare

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_the_shared_copy_is_the_published_file():
    text = tiny_shakespeare(SHARED)
    assert len(text) == 1_115_394 and len(set(text)) == 65
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")


def test_a_damaged_copy_is_named_with_its_path_and_the_fix(tmp_path):
    folder = tmp_path / "tinyshakespeare"
    folder.mkdir()
    good = (SHARED / "tinyshakespeare" / "input.txt").read_bytes()
    (folder / "input.txt").write_bytes(good[:-100])  # a truncated download
    with pytest.raises(RuntimeError, match=r"input.txt is not the published Tiny Shakespeare "
                                           r"\(1,115,294 bytes.*Delete it to download it again"):
        tiny_shakespeare(tmp_path)


def test_a_missing_file_is_downloaded_checked_and_kept(tmp_path, monkeypatch):
    good = (SHARED / "tinyshakespeare" / "input.txt").read_bytes()
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        return io.BytesIO(good)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    assert len(tiny_shakespeare(tmp_path)) == 1_115_394
    saved = tmp_path / "tinyshakespeare" / "input.txt"
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == TINY_SHAKESPEARE_SHA256
    assert not saved.with_suffix(".part").exists()
    tiny_shakespeare(tmp_path)
    assert len(calls) == 1 and calls[0].endswith("/tinyshakespeare/input.txt")


def test_no_file_and_no_network_says_where_it_looked_and_what_to_do(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match=r"not at .*tinyshakespeare/input.txt and could not be "
                                           r"downloaded \(URLError.*set D2LGPU_DATA"):
        tiny_shakespeare(tmp_path)
    assert not (tmp_path / "tinyshakespeare" / "input.txt").exists()
