"""dsslm.durable: writes that never replace what someone else saved."""
from __future__ import annotations

import errno
import json
import os

import pytest

from dsslm.durable import write_json_atomic


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_write_that_must_not_replace_keeps_an_existing_file_and_works_without_hard_links(tmp_path, monkeypatch,
                                                                                           links):
    """replace=False (dsslm.eval --json) linked a temporary file into place: on a filesystem without
    hard links (some FUSE, SMB or vfat mounts) that was an OSError, a traceback after the work."""
    if not links:
        def no_link(*args, **kwargs):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "result.json"
    write_json_atomic(path, {"a": 1}, replace=False)
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(FileExistsError):
        write_json_atomic(path, {"a": 2}, replace=False)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary file left
