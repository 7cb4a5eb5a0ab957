"""Every script in examples/ runs (with --quick), so the examples never rot.

On TensorFlow the single-process Keras 3 examples (the batch by memory,
mirrored training, the custom loop, TensorBoard, model parallelism, the
KerasHub fine-tune) run once per session, one after the other, from one
module fixture (`tests/_shared_process.py`), in one fresh process apart
from this one, each as a user runs it (`__main__`, its own arguments and
folder, 2 logical CPU devices, which this test process, with 4, can no
longer set up); each test reads its example's run. The others keep
processes of their own: the multi-worker and Ray examples start a cluster,
the preemption example kills and restarts its job, the TFMOT example needs
the tf_keras flavour before TensorFlow is imported, the testing example is
a pytest session of its own, and on JAX the KerasHub example needs 2 CPU
devices before JAX starts (this process has 4).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from _shared_process import run_shared

pytestmark = pytest.mark.backends("tensorflow", "jax")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO_ROOT, "examples")
BACKEND = os.environ["KERAS_BACKEND"]

# The CPU path (2 logical devices) on every machine, so the replica counts
# below hold with or without GPUs.
EXAMPLE_ENV = {
    "PYTHONPATH": REPO_ROOT,
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_USE_LEGACY_KERAS": "0",
    "CUDA_VISIBLE_DEVICES": "-1",
}


def _run_example(name: str, tmp_path, timeout: float, env=None, args=()):
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), "--quick", *args],
        cwd=tmp_path,
        env={**os.environ, **EXAMPLE_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (
        f"{name} exited with {result.returncode}\n--- stdout ---\n"
        f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )
    return result.stdout


# The examples of the shared TensorFlow process: the test that reads each
# one's output, and the seconds each may take on the loaded 2-core machine.
SHARED = {
    # First: its allocator figures drift with what ran before it.
    "batch_size_by_memory": ("test_batch_size_by_memory", 300),
    "mirrored_training": ("test_mirrored_training", 180),
    "custom_training_loop": ("test_custom_training_loop", 180),
    "tensorboard_monitoring": ("test_tensorboard_monitoring", 180),
    "model_parallel": ("test_model_parallel", 240),
    "fine_tune_keras_hub": ("test_fine_tune_keras_hub", 300),
}

# The first test to ask for the shared runs waits for all of them.
SHARED_TIMEOUT = pytest.mark.timeout(sum(t for _, t in SHARED.values()) + 60)


@pytest.fixture(scope="module")
def shared_runs(request, tmp_path_factory) -> tuple:
    """Runs the shared examples this session selected (a `-m "not slow"`
    run leaves the slow ones out), one after the other; returns
    their results and the folder each ran in."""
    selected = {
        item.originalname
        for item in request.session.items
        if item.module is request.module
    }
    runs, folders = {}, {}
    for name, (test, _) in SHARED.items():
        if test in selected:
            folders[name] = tmp_path_factory.mktemp(name)
            script = os.path.join(EXAMPLES, f"{name}.py")
            runs[name] = ([script, "--quick"], folders[name])
    results = run_shared(
        runs,
        tmp_path_factory.mktemp("shared"),
        # CPU allocator statistics need oneDNN (the batch by memory; the
        # TensorBoard example turns it on itself), whatever the suite runs
        # with; it is TensorFlow's default on x86.
        env={**EXAMPLE_ENV, "TF_ENABLE_ONEDNN_OPTS": "1"},
        timeout=sum(SHARED[name][1] for name in runs),
    )
    return results, folders


def _shared(shared_runs, name: str) -> tuple:
    """The stdout of shared example `name` (asserted to have exited with
    0) and the folder it ran in."""
    results, folders = shared_runs
    return results[name].check(f"{name}.py"), folders[name]


def _number(pattern: str, text: str) -> float:
    found = re.findall(pattern, text)
    assert found, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(found[-1])


def test_every_example_is_tested():
    scripts = sorted(
        f for f in os.listdir(EXAMPLES) if f.endswith((".py", ".sh"))
    )
    assert scripts == [
        "batch_size_by_memory.py",
        "custom_training_loop.py",
        "fine_tune_keras_hub.py",
        "jax_multi_process.py",  # test_jax_cluster_example_jax.py
        "launch_tf_config.sh",
        "mirrored_training.py",
        "model_parallel.py",
        "multi_worker.py",
        "preemption_resume.py",
        "ray_train.py",
        "tensorboard_monitoring.py",
        "tfmot_pruning.py",
    ]


def test_examples_use_only_public_names():
    private = re.compile(r"keras_mgpu(\.\w+)*\._\w+")
    for name in os.listdir(EXAMPLES):
        if name.endswith(".py"):
            text = open(os.path.join(EXAMPLES, name)).read()
            assert not private.search(text), (name, private.search(text)[0])


@pytest.mark.backends("tensorflow")
@SHARED_TIMEOUT
def test_mirrored_training(shared_runs):
    out, tmp_path = _shared(shared_runs, "mirrored_training")
    assert "2 replicas" in out
    assert "global batch 256 = 32 per replica x 2 replicas x 4 steps" in out
    # 2048 samples / 64 per step = 32 steps, 8 updates an epoch, 2 epochs.
    assert _number(r"updates: (\d+)", out) == 16
    # Scaled x8 (256 / 32) and warmed up over the first epoch.
    assert _number(r"final learning rate: ([\d.e-]+)", out) == pytest.approx(
        8e-3, rel=1e-4
    )
    assert _number(r"final validation accuracy: ([\d.]+)", out) > 0.5
    run = tmp_path / "mirrored_training_run"
    assert (run / "history.csv").exists()
    with open(run / "history.png", "rb") as f:
        assert f.read(4) == b"\x89PNG"


@pytest.mark.backends("tensorflow")
@SHARED_TIMEOUT
def test_custom_training_loop(shared_runs):
    out, _ = _shared(shared_runs, "custom_training_loop")
    # 32 micro-steps an epoch, 4 per update, 2 epochs.
    assert "micro-steps: 64, updates (optimizer.iterations): 16" in out
    assert _number(r"final validation accuracy: ([\d.]+)", out) > 0.5


@pytest.mark.slow  # ~90 s on the loaded 2-core CI machine
@SHARED_TIMEOUT
def test_fine_tune_keras_hub(shared_runs_if_tf, tmp_path):
    """On each backend: TensorFlow's MirroredStrategy in the shared
    process, JAX's DataParallel in a process of its own."""
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip('keras-hub is not installed ("keras-mgpu[hub]")')
    if BACKEND == "tensorflow":
        out, _ = _shared(shared_runs_if_tf, "fine_tune_keras_hub")
    else:
        # Without this process's XLA_FLAGS (4 CPU devices): the example
        # asks for 2 before JAX starts.
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(EXAMPLES, "fine_tune_keras_hub.py"),
                "--quick",
            ],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": REPO_ROOT, "KERAS_BACKEND": "jax"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        out = result.stdout
        assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert f"backend: {BACKEND}" in out and "2 replicas" in out
    # Both encoder layers of the 2-layer BERT switched; the backbone is
    # still a BertBackbone inside the user's classifier.
    assert (
        "recomputed layers: 2 (transformer_layer_0, transformer_layer_1) "
        "in the BertBackbone of model 'classifier'"
    ) in out
    assert "global batch 64 = 8 per replica x 2 replicas x 4 steps" in out
    # 256 samples / 16 per micro-step / 4 per update, 2 epochs.
    assert _number(r"updates: (\d+)", out) == 8
    assert re.search(r"memory keys: mem/host_rss_mb", out)
    # ThroughputMonitor's figures of the last epoch (no peak on a CPU).
    assert re.search(r"last epoch: \d+\.\d samples/s, \d+ tokens/s", out)
    assert _number(r"last epoch: ([\d.]+) samples/s", out) > 0
    assert _number(r"samples/s, ([\d.]+) tokens/s", out) > 0
    first = _number(r"first epoch loss: ([\d.]+)", out)
    final = _number(r"final loss: ([\d.]+)", out)
    assert 0 < final < 1.0 and 0 < first < 1.0  # finite, near ln 2


@pytest.fixture
def shared_runs_if_tf(request):
    """`shared_runs` in the TensorFlow job; None in the JAX job (whose
    examples run in processes of their own)."""
    if BACKEND != "tensorflow":
        return None
    return request.getfixturevalue("shared_runs")


@pytest.mark.backends("tensorflow")
@SHARED_TIMEOUT
def test_tensorboard_monitoring(shared_runs):
    out, tmp_path = _shared(shared_runs, "tensorboard_monitoring")
    tags = set(re.findall(r"^  train: (\S+) = ", out, flags=re.M))
    assert {"epoch_loss", "epoch_mem/host_rss_mb"} <= tags, tags
    # No GPU here (CUDA_VISIBLE_DEVICES=-1): CPU utilization instead.
    assert "epoch_cpu/util_mean_pct" in tags, tags
    # Read back from the event files themselves, not from the logs.
    assert glob.glob(
        str(tmp_path / "tensorboard_monitoring_run/logs/train/events.*")
    )
    assert _number(r"CSV columns from the monitors: (\d+)", out) >= 5


@pytest.mark.slow  # ~90 s on the loaded 2-core CI machine
@pytest.mark.backends("tensorflow")
def test_preemption_resume(tmp_path):
    out = _run_example("preemption_resume.py", tmp_path, timeout=300)
    assert "[job] SIGKILL in epoch 2, step 10/16" in out
    assert "start 1 exited with -9" in out
    # The restart resumed after the epoch-1 backup, not from scratch...
    assert re.findall(r"\[job\] first epoch run: (\d+)", out) == ["1", "2"]
    assert "[reference] first epoch run: 1" in out
    # ...and ended where the uninterrupted run did: 3 epochs of 16 steps,
    # 2 per update, the accumulation window cut by the kill included.
    assert "[job] finished, updates: 24" in out
    assert "[reference] finished, updates: 24" in out
    difference = _number(
        r"max abs weight difference, resumed vs uninterrupted: ([\d.e-]+)",
        out,
    )
    assert difference < 1e-6


@pytest.mark.backends("tensorflow")
@SHARED_TIMEOUT
def test_batch_size_by_memory(shared_runs):
    # With oneDNN on (see shared_runs): CPU allocator statistics need it.
    out, _ = _shared(shared_runs, "batch_size_by_memory")
    assert "the largest batch is" in out  # the measured part of the decision
    split = re.findall(
        r"global batch (\d+) = (\d+) per replica x (\d+) replicas x "
        r"(\d+) accumulation steps",
        out,
    )
    assert len(split) == 1, out[-2000:]
    total, per_replica, replicas, steps = map(int, split[0])
    assert total == per_replica * replicas * steps == 2048
    # The 12 MB budget holds less than the 1,024 each replica would need
    # without accumulation (the exact micro-batch varies with the
    # allocator's measurements).
    assert replicas == 2 and steps >= 2
    assert "optimizer: GradientAccumulationOptimizer" in out
    assert "learning rate: 0.001 -> 0.008" in out  # x 2048 / 256
    # 4096 samples / 2048 per update, 2 epochs, whatever the split.
    assert _number(r"updates: (\d+)", out) == 4
    assert _number(r"final learning rate: ([\d.e-]+)", out) == pytest.approx(
        0.008
    )


@pytest.mark.backends("tensorflow")
@SHARED_TIMEOUT
def test_model_parallel(shared_runs):
    out, tmp_path = _shared(shared_runs, "model_parallel")
    stages = re.findall(
        r"stage (\d) on /device:CPU:(\d): (\d+) layers, (\d+) parameters",
        out,
    )
    # Two stages, one per logical device, holding every parameter between
    # them; balanced by parameter bytes (neither holds 2/3 of the model).
    assert [(s, d) for s, d, _, _ in stages] == [("0", "0"), ("1", "1")]
    total = _number(r"parameters: (\d+)\n", out)
    assert sum(int(p) for *_, p in stages) == total
    assert all(int(p) < 2 * total / 3 for *_, p in stages)
    assert "4 micro-batches per step" in out  # placement_report's table
    assert _number(r"final validation accuracy: ([\d.]+)", out) > 0.3
    assert (tmp_path / "model_parallel_run" / "placed.keras").exists()
    assert _number(r"unplaced copy: (\d+) parameters", out) == total


def _launch(*args, env=None, timeout=60):
    # A session of its own, so that on a time-out the workers the launcher
    # started go with it (killing bash alone would orphan them).
    process = subprocess.Popen(
        ["bash", os.path.join(EXAMPLES, "launch_tf_config.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(
        process.args, process.returncode, stdout, stderr
    )


def _tf_configs(out: str) -> list[dict]:
    return [json.loads(c) for c in re.findall(r"TF_CONFIG='(.*?)'", out)]


@pytest.mark.backends("tensorflow")
def test_launch_tf_config_sh(tmp_path):
    script = os.path.join(EXAMPLES, "launch_tf_config.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    # A local cluster, for real: each worker sees its own TF_CONFIG.
    show = (
        "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
        "print('task', c['task']['index'], 'of', c['cluster']['worker'])"
    )
    result = _launch("-n", "3", "--", sys.executable, "-c", show)
    assert result.returncode == 0, result.stderr
    hosts = [f"127.0.0.1:{23456 + i}" for i in range(3)]
    # Each worker's lines carry its index (the launcher prefixes them).
    assert sorted(
        re.findall(r"^\[worker (\d)\] task (\d) of (.*)$", result.stdout, re.M)
    ) == [(str(i), str(i), str(hosts)) for i in range(3)]
    # A line written in pieces stays whole: worker 0 starts its line, waits
    # until worker 1 has written a whole line, then ends its own.
    pieces = (
        "import json, os, sys, time; "
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
        "flag = os.environ['FLAG']\n"
        "if i == 0:\n"
        "    sys.stdout.write('first'); sys.stdout.flush()\n"
        "    deadline = time.monotonic() + 30\n"
        "    while not os.path.exists(flag) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    sys.stdout.write(' half\\n'); sys.stdout.flush()\n"
        "else:\n"
        "    sys.stdout.write('whole\\n'); sys.stdout.flush()\n"
        "    open(flag, 'w').close()\n"
    )
    result = _launch(
        "--", sys.executable, "-c", pieces, env={"FLAG": str(tmp_path / "f")}
    )
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stdout.splitlines() if x.startswith("[")]
    assert sorted(lines) == ["[worker 0] first half", "[worker 1] whole"]
    # A failing worker fails the launch.
    fail = "import sys; sys.exit(3)"
    assert _launch("--", sys.executable, "-c", fail).returncode == 3
    # Slurm: task 3 of 2 nodes x 2 tasks (node[01-02]), without Slurm.
    result = _launch(
        "--dry-run",
        "--",
        "python",
        "train.py",
        env={
            "SLURM_PROCID": "3",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_NODELIST": "node[01-02]",
            "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
        },
    )
    assert result.returncode == 0, result.stderr
    [config] = _tf_configs(result.stdout)
    assert config == {
        "cluster": {
            "worker": [
                "node01:23456",
                "node01:23457",
                "node02:23456",
                "node02:23457",
            ]
        },
        "task": {"type": "worker", "index": 3},
    }
    assert result.stdout.rstrip().endswith(" python train.py")
    # A host list: this process is --index.
    command = ("--", "python", "train.py")
    result = _launch("--hosts", "a,b", "--index", "1", "--dry-run", *command)
    [config] = _tf_configs(result.stdout)
    assert config["cluster"]["worker"] == ["a:23456", "b:23456"]
    assert config["task"]["index"] == 1
    result = _launch("--hosts", "a,b", "--dry-run", *command)
    assert result.returncode == 2 and "--index" in result.stderr
    result = _launch("--dry-run")
    assert result.returncode == 2 and "no command" in result.stderr


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (for now)."""
    import socket

    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_launch_tf_config_sh_trains_the_multi_worker_example(tmp_path):
    result = _launch(
        "-n",
        "2",
        "--",
        sys.executable,
        os.path.join(EXAMPLES, "multi_worker.py"),
        "--quick",
        # One epoch: what this test checks is the launcher's cluster (the
        # two-epoch run is test_multi_worker_launches_two_local_workers).
        "--epochs",
        "1",
        "--backup-dir",
        str(tmp_path / "backup"),
        env={
            "PORT": str(_free_port_pair()),
            "PYTHONPATH": REPO_ROOT,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_USE_LEGACY_KERAS": "0",
            "CUDA_VISIBLE_DEVICES": "-1",
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(_tf_configs(result.stdout)) == 2
    assert "[worker 0] task 0 of 2 workers (chief): 2 replicas" in result.stdout
    assert "[worker 1] task 1 of 2 workers: 2 replicas" in result.stdout
    # Whole lines per worker, also when Python runs unbuffered and writes a
    # line in pieces (CI's PYTHONUNBUFFERED once mixed the two workers'
    # final lines into one).
    finals = re.findall(
        r"^\[worker (\d)\] updates: 16, .* weights checksum: (\S+)$",
        result.stdout,
        re.M,
    )
    assert sorted(w for w, _ in finals) == ["0", "1"], result.stdout[-3000:]
    assert finals[0][1] == finals[1][1]  # in sync


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_multi_worker_launches_two_local_workers(tmp_path):
    out = _run_example(
        "multi_worker.py", tmp_path, timeout=300, args=("--timeout", "240")
    )
    assert out.count("TF_CONFIG='") == 2
    assert '"127.0.0.1:' in out
    assert "[worker 0] task 0 of 2 workers (chief): 2 replicas" in out
    assert "[worker 1] task 1 of 2 workers: 2 replicas" in out
    finals = re.findall(
        r"\[worker (\d)\] updates: (\d+), final validation accuracy: ([\d.]+)",
        out,
    )
    assert sorted(w for w, _, _ in finals) == ["0", "1"]
    # 32 micro-steps an epoch, 2 per update, 2 epochs; both workers hold
    # the same weights, so they measure the same accuracy.
    assert {u for _, u, _ in finals} == {"32"}
    assert len({a for _, _, a in finals}) == 1
    assert float(finals[0][2]) > 0.5
    checksums = re.findall(r"weights checksum: ([-\d.]+)", out)
    assert len(checksums) == 2 and len(set(checksums)) == 1
    assert "workers/step_time_ratio" in out  # StragglerMonitor, chief's bar


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_ray_train_runs_keras3_fit_on_two_workers(tmp_path):
    if importlib.util.find_spec("ray") is None:
        pytest.skip('Ray is not installed (pip install "keras-mgpu[ray]")')
    out = _run_example("ray_train.py", tmp_path, timeout=420)
    workers = re.findall(
        r"worker (\d): updates (\d+), accuracy ([\d.]+), weights checksum "
        r"([-\d.]+), optimizer (\S+), TF_USE_LEGACY_KERAS=(\S+), "
        r"TF_CONFIG=(.*)",
        out,
    )
    assert [w[0] for w in workers] == ["0", "1"]
    # 1024 samples / 64 per micro-step / 2 per update, 2 epochs.
    assert {w[1] for w in workers} == {"16"}
    assert len({w[3] for w in workers}) == 1  # identical weights
    for worker in workers:
        # Ray set the tf_keras switch; the user's Keras 3 objects still got
        # keras_mgpu's Keras 3 components.
        assert worker[5] == "1"
        assert worker[4] == "keras_mgpu.optimizers.gradient_accumulation"
        hosts = json.loads(worker[6])["cluster"]["worker"]
        assert {h.rsplit(":", 1)[0] for h in hosts} == {"127.0.0.1"}


@pytest.mark.backends("tensorflow")
def test_tfmot_pruning(tmp_path):
    # find_spec, not importorskip: importing TFMOT here would set
    # TF_USE_LEGACY_KERAS=1 for the rest of this Keras 3 test session.
    if importlib.util.find_spec("tensorflow_model_optimization") is None:
        pytest.skip("tensorflow-model-optimization is not installed")
    out = _run_example(
        "tfmot_pruning.py",
        tmp_path,
        timeout=180,
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    # 32 steps an epoch, 2 per update, 3 epochs.
    assert _number(r"updates: (\d+)", out) == 48
    assert _number(r"sparsity after strip_pruning: ([\d.]+)", out) == (
        pytest.approx(0.8, abs=0.01)
    )
    assert _number(r"accuracy \(pruned model\): ([\d.]+)", out) > 0.3


@pytest.mark.backends("tensorflow")
def test_the_testing_example_project_passes_with_the_plugin():
    """examples/testing: a user's tests run by pytest with keras_mgpu's
    plugin activated from its pytest.ini (every strategy of the matrix and
    a 2-worker cluster)."""
    project = os.path.join(EXAMPLES, "testing")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=project,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_USE_LEGACY_KERAS": "0",
            "CUDA_VISIBLE_DEVICES": "-1",
        },
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "6 passed" in result.stdout
    assert "keras_mgpu.testing: 4 logical CPU devices" in result.stdout
