"""What every ``prunopt repro NAME`` shares: the claims table, deterministic
runs, and files written atomically with the user's umask.

A reproduction builds a :class:`Report`: a table ``claim | paper value |
prunopt value | verdict | note`` (one row per claim of the paper it tests),
free-form sections (the detailed tables), the raw numbers, and the command,
seeds and thread count that produced it. :meth:`Report.write` prints it and
writes ``<name>.md`` and ``<name>.json`` (and the figures it is given) into
the output folder, then says where.

Verdicts: ``reproduced`` (the paper's value or statement holds within the
stated tolerance), ``qualitatively`` (the direction or pattern holds, the
numbers do not), ``not reproduced``.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

VERDICTS = ("reproduced", "qualitatively", "not reproduced")


@dataclass
class Claim:
    """One row of a reproduction's table."""

    claim: str
    paper: str
    prunopt: str
    verdict: str
    note: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass
class Report:
    """A reproduction's results: the claims table, sections of markdown, the raw
    numbers (``data``, JSON-serialisable) and how they were produced."""

    name: str
    title: str
    command: str
    seeds: List[int]
    threads: int
    settings: Dict[str, object] = field(default_factory=dict)
    claims: List[Claim] = field(default_factory=list)
    sections: List[tuple] = field(default_factory=list)
    data: Dict[str, object] = field(default_factory=dict)
    wall_s: float = 0.0
    #: CPU time of the process(es) that computed it (0: not recorded)
    cpu_s: float = 0.0

    def claim(self, claim: str, paper, prunopt, verdict: str, note: str = "") -> Claim:
        c = Claim(claim, str(paper), str(prunopt), verdict, note)
        self.claims.append(c)
        return c

    def section(self, heading: str, text: str) -> None:
        self.sections.append((heading, text.rstrip() + "\n"))

    def claims_markdown(self) -> str:
        rows = [[c.claim, c.paper, c.prunopt, f"**{c.verdict}**", c.note] for c in self.claims]
        return markdown_table(["claim", "paper value", "prunopt value", "verdict", "note"], rows)

    def verdict_counts(self) -> Dict[str, int]:
        return {v: sum(c.verdict == v for c in self.claims) for v in VERDICTS}

    def to_markdown(self) -> str:
        counts = self.verdict_counts()
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        head = [f"# {self.title}", "",
                f"Command: `{self.command}`  ",
                f"Seeds: {format_seeds(self.seeds)}; threads: {self.threads}; "
                f"wall time {self.wall_s:.0f} s" + (f", CPU time {self.cpu_s:.0f} s" if self.cpu_s else "")
                + (f"; {settings}" if settings else ""), "",
                "Verdicts: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS), "",
                self.claims_markdown()]
        body = []
        for heading, text in self.sections:
            body += ["", f"## {heading}", "", text.rstrip()]
        return "\n".join(head + body) + "\n"

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title, "command": self.command, "seeds": list(self.seeds),
                "threads": self.threads, "settings": self.settings, "claims": [asdict(c) for c in self.claims],
                "verdicts": self.verdict_counts(), "data": self.data, "wall_s": self.wall_s,
                "cpu_s": self.cpu_s}

    def write(self, out: str, figures: Optional[Dict[str, Callable[[str], None]]] = None) -> List[str]:
        """Prints the report and writes ``<out>/<name>.md``, ``<out>/<name>.json``
        and every ``figures[filename](path)``; returns the paths (also printed)."""
        os.makedirs(out, exist_ok=True)
        paths = []
        for fname, draw in (figures or {}).items():
            path = os.path.join(out, fname)
            draw(path)
            paths.append(path)
        md_path, json_path = os.path.join(out, f"{self.name}.md"), os.path.join(out, f"{self.name}.json")
        write_text(json_path, json.dumps(self.to_json(), indent=1, default=_json_default) + "\n")
        write_text(md_path, self.to_markdown())
        paths = [md_path, json_path] + paths
        print(self.to_markdown(), flush=True)
        print("wrote " + ", ".join(paths), flush=True)
        return paths


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (``|`` in cells escaped)."""
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def format_seeds(seeds: Sequence[int]) -> str:
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]} ({len(seeds)})"
    return ", ".join(str(s) for s in seeds)


def mean_std(values: Sequence[float]):
    """Mean and sample standard deviation (0 for one value)."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("mean_std of no values")
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s


def pm(values: Sequence[float], fmt: str = ".3f") -> str:
    """``mean ± std`` of ``values``, formatted."""
    m, s = mean_std(values)
    return f"{m:{fmt}} ± {s:{fmt}}"


def sig(v: float, digits: int = 2) -> str:
    """A number in the paper's style: 2 significant digits, exponent below 1e-2."""
    if v == 0 or not math.isfinite(v):
        return str(v)
    if abs(v) < 1e-2 or abs(v) >= 1e4:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{max(digits, 3)}g}"


# ---------------------------------------------------------------- running
def scale(args) -> str:
    """``"tiny"``, ``"quick"`` or ``"full"`` from ``--tiny`` / ``--quick``."""
    return "tiny" if getattr(args, "tiny", False) else "quick" if getattr(args, "quick", False) else "full"


def seeds_from(args, default_count: int) -> List[int]:
    """``--seed S --seeds N``: the seeds ``S, S+1, ..., S+N-1`` (``N`` defaults
    to the reproduction's ``default_count``)."""
    n = getattr(args, "seeds", None) or default_count
    if n < 1:
        raise ValueError(f"--seeds must be >= 1, got {n}")
    return [args.seed + i for i in range(n)]


def repro_command(args, name: str, keys: Sequence[str] = ()) -> str:
    """The ``prunopt repro`` command line that reruns ``args`` (the common
    options and the reproduction's own ``keys`` that are set)."""
    parts = ["prunopt", "repro", name, "--out", str(args.out), "--seed", str(args.seed)]
    if getattr(args, "seeds", None):
        parts += ["--seeds", str(args.seeds)]
    parts += ["--threads", str(args.threads)]
    for flag in ("quick", "tiny"):
        if getattr(args, flag, False):
            parts.append(f"--{flag}")
    for k in keys:
        v = getattr(args, k, None)
        if v is None or v is False:
            continue
        opt = "--" + k.replace("_", "-")
        parts += [opt] if v is True else [opt, str(v)]
    return " ".join(parts)


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Runs the block with ``threads`` intra-op threads and
    ``torch.use_deterministic_algorithms(True)``; restores both after. Seeds are
    the caller's (every experiment seeds its own generators)."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
        torch.set_num_threads(prev_threads)


class Timer:
    """``with Timer() as t: ...; t.seconds``: the wall time of the block, and
    ``t.cpu_seconds``, the CPU time the process spent in it (every thread)."""

    def __enter__(self):
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start
        return False


def load_parts(dirs: str, name: str) -> List[dict]:
    """The ``<name>.json`` reports in the comma-separated folders ``dirs`` (the
    pieces of a run made in several processes, ``--merge``)."""
    folders = [d.strip() for d in str(dirs).split(",") if d.strip()]
    if not folders:
        raise ValueError("--merge: no folders given")
    parts = []
    for d in folders:
        path = os.path.join(d, f"{name}.json")
        if not os.path.exists(path):
            raise ValueError(f"--merge: {path} does not exist")
        with open(path) as f:
            parts.append(json.load(f))
    return parts


def pieces_section(rep: "Report", parts: Sequence[dict], how: Optional[str] = None) -> None:
    """A section listing the command, wall time (and CPU time, where the piece
    recorded it) of every merged piece. The merge cannot know how the
    processes were scheduled (one after another, side by side, their
    priority); ``how`` says it where the caller does."""
    cpu = any(p.get("cpu_s") for p in parts)
    rows = [[f"`{p['command']}`", f"{p['wall_s']:.0f}"] + ([f"{p.get('cpu_s', 0.0):.0f}"] if cpu else [])
            for p in parts]
    total = sum(p["wall_s"] for p in parts)
    cpu_total = f", {sum(p.get('cpu_s', 0.0) for p in parts):.0f} s of CPU time" if cpu else ""
    rep.section("How it was run", f"{len(parts)} processes{', ' + how if how else ''}, {total:.0f} s of wall time summed over them"
                f"{cpu_total}; then the merge command above.\n\n"
                + markdown_table(["piece", "wall s"] + (["CPU s"] if cpu else []), rows))


def same_setting(parts: Sequence[dict], key: str, what: str = "settings"):
    """``parts[i]["data"][key]``, which every part must share."""
    vals = [json.dumps(p["data"].get(key), sort_keys=True) for p in parts]
    if len(set(vals)) > 1:
        raise ValueError(f"--merge: the parts disagree on their {what}")
    return parts[0]["data"].get(key)


# ---------------------------------------------------------------- files
def _temp_beside(path: str):
    """A new file next to ``path``, created with mode 0o666 minus the umask
    (``tempfile.mkstemp`` would make it 0o600 and ``os.replace`` keeps that)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    while True:
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def write_atomic(path: str, write: Callable[[object], None], binary: bool = False) -> None:
    """Calls ``write(f)`` on a new file beside ``path`` and renames it to
    ``path``: readers never see a half-written file, and the file gets the
    user's umask like any ``open(path, "w")``."""
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically with the user's umask."""
    write_atomic(path, lambda f: f.write(text))


def save_figure(fig, path: str, dpi: int = 100) -> None:
    """Saves a matplotlib figure as PNG atomically with the user's umask and
    closes it."""
    import matplotlib.pyplot as plt

    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight"), binary=True)
    finally:
        plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
