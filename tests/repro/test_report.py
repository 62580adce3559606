"""The shared pieces of ``prunopt repro``: claims table, deterministic runs,
files written with the user's umask."""
import json
import os
import stat

import pytest
import torch

from prunopt.repro.report import (
    Report,
    deterministic,
    markdown_table,
    mean_std,
    pm,
    repro_command,
    save_figure,
    seeds_from,
    write_text,
)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_files_get_the_users_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text(str(tmp_path / "a.md"), "x\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.plot([0, 1])
        save_figure(fig, str(tmp_path / "a.png"))
        with open(tmp_path / "ref", "w") as f:  # what a plain open() gives
            f.write("x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.md") == _mode(tmp_path / "ref") == 0o666 & ~umask
    assert _mode(tmp_path / "a.png") == 0o666 & ~umask
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["a.md", "a.png", "ref"]  # no temporary left


def test_write_text_leaves_nothing_on_error(tmp_path):
    from prunopt.repro.report import write_atomic

    (tmp_path / "keep.txt").write_text("old")

    def boom(f):
        f.write("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_atomic(str(tmp_path / "keep.txt"), boom)
    assert (tmp_path / "keep.txt").read_text() == "old" and os.listdir(tmp_path) == ["keep.txt"]


def test_report_writes_table_json_and_says_where(tmp_path, capsys):
    rep = Report("demo", "Demo", "prunopt repro demo", [0, 1, 2], 1, {"epochs": 3})
    rep.claim("a | b", "1", "2", "reproduced", "pipe escaped")
    rep.claim("c", 1.5, 2.5, "not reproduced")
    rep.section("Details", "| x |\n|---|\n| 1 |")
    rep.data = {"t": torch.tensor([1.0, 2.0])}
    paths = rep.write(str(tmp_path), {"demo.png": lambda p: open(p, "wb").write(b"png")})
    out = capsys.readouterr().out
    assert paths == [str(tmp_path / "demo.md"), str(tmp_path / "demo.json"), str(tmp_path / "demo.png")]
    assert "wrote " + ", ".join(paths) in out
    md = (tmp_path / "demo.md").read_text()
    assert "| a \\| b | 1 | 2 | **reproduced** | pipe escaped |" in md
    assert "Seeds: 0..2 (3); threads: 1" in md and "1 reproduced, 0 qualitatively, 1 not reproduced" in md
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["claims"][1] == {"claim": "c", "paper": "1.5", "prunopt": "2.5", "verdict": "not reproduced", "note": ""}
    assert data["seeds"] == [0, 1, 2] and data["threads"] == 1 and data["data"]["t"] == [1.0, 2.0]
    with pytest.raises(ValueError, match="verdict"):
        rep.claim("x", 1, 2, "maybe")


def test_deterministic_restores_threads_and_flags():
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    with deterministic(1):
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before
    with pytest.raises(ValueError, match="threads"):
        with deterministic(0):
            pass


def test_small_helpers():
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    assert mean_std([4.0]) == (4.0, 0.0)
    assert pm([1.0, 3.0], ".1f") == "2.0 ± 1.4"
    with pytest.raises(ValueError):
        mean_std([])
    assert markdown_table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"

    class A:
        out, seed, seeds, threads, quick, tiny, prunadag_runs, flag = "o", 3, 2, 1, True, False, 5, True

    assert seeds_from(A, 5) == [3, 4]
    assert repro_command(A, "x", ["prunadag_runs", "flag"]) == \
        "prunopt repro x --out o --seed 3 --seeds 2 --threads 1 --quick --prunadag-runs 5 --flag"


def test_timer_cpu_time_and_pieces_section(tmp_path):
    """CPU time is recorded beside wall time, shown in the header only when
    recorded, and the pieces section sums both without claiming a schedule."""
    from prunopt.repro.report import Timer, pieces_section

    with Timer() as t:
        sum(i * i for i in range(200_000))  # some CPU work
    assert t.cpu_seconds > 0 and t.seconds > 0
    rep = Report("demo", "Demo", "prunopt repro demo --merge a,b", [0], 1)
    assert "CPU time" not in rep.to_markdown()
    rep.wall_s, rep.cpu_s = 30.0, 20.0
    assert "wall time 30 s, CPU time 20 s" in rep.to_markdown()
    parts = [{"command": "prunopt repro demo --out a", "wall_s": 10.0, "cpu_s": 6.0},
             {"command": "prunopt repro demo --out b", "wall_s": 20.0, "cpu_s": 14.0}]
    pieces_section(rep, parts)
    heading, text = rep.sections[-1]
    assert heading == "How it was run"
    assert text.startswith("2 processes, 30 s of wall time summed over them, 20 s of CPU time")
    assert "| `prunopt repro demo --out b` | 20 | 14 |" in text
    pieces_section(rep, [{"command": "c", "wall_s": 5.0}], how="one after another")
    assert rep.sections[-1][1].startswith("1 processes, one after another, 5 s of wall time summed over them;")
    assert "CPU s" not in rep.sections[-1][1]
    assert json.loads(json.dumps(rep.to_json()))["cpu_s"] == 20.0
