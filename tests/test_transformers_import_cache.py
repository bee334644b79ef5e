"""The disk cache of transformers' lazy-import tables gives what transformers computes, and
computes again when a scanned file changes or the entry is damaged."""
from __future__ import annotations

import os

from llmserve import transformers_import_cache as tic


def _package(root) -> str:
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_a.py").write_text('__all__ = ["AConfig"]\nclass AConfig: pass\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "configuration_b.py").write_text('__all__ = ["BConfig"]\nclass BConfig: pass\n')
    return str(pkg)


def test_cached_tables_equal_transformers_and_follow_file_changes(tmp_path, monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(tic, "cache_dir", lambda: str(tmp_path / "cache"))
    original = import_utils.define_import_structure
    original = getattr(original, "__wrapped_original__", original).__wrapped__  # transformers' uncached
    calls = []

    def counted(*args):
        calls.append(args)
        return original(*args)

    pkg = _package(tmp_path)
    want = original(pkg, "p")
    assert any("p.configuration_a" in v for v in want.values())
    assert tic.cached(counted, "v")(pkg, "p") == want and len(calls) == 1   # computed, written
    assert tic.cached(counted, "v")(pkg, "p") == want and len(calls) == 1   # a new process: from disk
    tic._fingerprint.cache_clear()  # a new process
    import_utils.create_import_structure_from_path.cache_clear()  # transformers' own per-process cache
    with open(os.path.join(pkg, "sub", "configuration_b.py"), "w") as f:
        f.write('__all__ = ["BConfig", "BOther"]\nclass BConfig: pass\nclass BOther: pass\n')
    changed = tic.cached(counted, "v")(pkg, "p")
    assert len(calls) == 2 and changed == original(pkg, "p") != want          # the edit is seen
    for name in os.listdir(tmp_path / "cache"):
        (tmp_path / "cache" / name).write_bytes(b"not a pickle")
    assert tic.cached(counted, "v")(pkg, "p") == changed and len(calls) == 3  # damaged: computed again


def test_install_only_before_transformers_is_imported(monkeypatch):
    import transformers.utils.import_utils  # noqa: F401  (imported by the test session anyway)
    assert tic.install() is False
