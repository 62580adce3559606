"""Every script of examples/ runs with --tiny (the DDP one under torchrun with 2 ranks)."""
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ["prunadag_training.py", "probmask_budget.py", "interspace_inference.py",
            "ds_channel_removal.py", "rigl_resnet.py", "budget_projection_figure.py"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--tiny"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_projection_figure_is_written_where_out_points(tmp_path):
    out = tmp_path / "projection.png"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "budget_projection_figure.py"), "--tiny",
                           "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {out}" in proc.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_example_ranks_stay_identical():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(ROOT / "examples" / "ddp_prunadag.py"), "--tiny"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parameters bit-identical" in proc.stdout
