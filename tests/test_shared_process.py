"""tests/_shared_process.py: scripts run one after the other in one fresh
process, each as `__main__` with its own arguments, folder, environment
and output, and each one's end reported (tiny scripts: no TensorFlow)."""

from __future__ import annotations

import os

from _shared_process import run_shared

SCRIPTS = {
    "first": (
        "import os, sys\n"
        "print('argv', sys.argv[1:], 'cwd', os.path.basename(os.getcwd()),\n"
        "      'name', __name__, 'env', os.environ.get('SHARED_TEST'))\n"
        "os.environ['LEAKED'] = '1'\n"
        "sys.stderr.write('to stderr\\n')\n"
        "os.write(2, b'native stderr\\n')\n"
    ),
    "exits": (
        "import os\n"
        "print('leaked', os.environ.get('LEAKED'))\n"
        "raise SystemExit('a message')\n"
    ),
    "raises": "raise ValueError('boom')\n",
    "module": None,  # `-m json.tool --help`: a module as __main__
    "dies": "import os\nprint('started', flush=True)\nos._exit(9)\n",
    "after": "print('never')\n",
}


def test_scripts_run_in_order_each_as_a_fresh_start(tmp_path):
    runs = {}
    for name, text in SCRIPTS.items():
        folder = tmp_path / name
        folder.mkdir()
        if text is None:
            runs[name] = (["-m", "json.tool", "--help"], str(folder))
            continue
        script = tmp_path / f"{name}.py"
        script.write_text(text)
        runs[name] = ([str(script), "--flag", name], str(folder))
    shared = tmp_path / "shared"
    shared.mkdir()
    results = run_shared(runs, shared, {"SHARED_TEST": "on"}, timeout=120)
    first = results["first"]
    assert first.check("first") == (
        "argv ['--flag', 'first'] cwd first name __main__ env on\n"
    )
    assert first.stderr == "to stderr\nnative stderr\n"
    # The environment is the given one again for the next script.
    exits = results["exits"]
    assert (exits.returncode, exits.stdout) == (1, "leaked None\n")
    assert exits.stderr == "a message\n"
    raises = results["raises"]
    assert raises.returncode == 1
    assert "ValueError: boom" in raises.stderr
    assert results["module"].check("module").startswith("usage: ")
    # A script that ends the process: it never ended, the next never ran.
    dies = results["dies"]
    assert (dies.returncode, dies.stdout) == (-1, "started\n")
    assert dies.stderr.startswith("the process exited with 9")
    after = results["after"]
    assert (after.returncode, after.stdout) == (-1, "")
    assert after.stderr.startswith("not run: the process exited with 9")
    assert os.path.exists(shared / "runs.json")
