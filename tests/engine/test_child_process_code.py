"""Child processes (engine, TP workers) run the parent's llmserve, never a ``llmserve/``
folder that happens to sit in the working directory (a user trial: an old checkout there
took over the engine under an up-to-date front end)."""
import subprocess

import llmserve
from llmserve.proc_utils import same_code_command


def test_a_llmserve_folder_in_the_working_directory_is_not_imported(tmp_path):
    (tmp_path / "llmserve").mkdir()
    (tmp_path / "llmserve" / "__init__.py").write_text("raise SystemExit('the shadow copy was imported')\n")
    cmd, env = same_code_command("unused")
    probe = cmd[:-2] + ["-c", "import llmserve; print(llmserve.__file__)"]  # the same flags and env, -c for -m
    out = subprocess.run(probe, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == llmserve.__file__
