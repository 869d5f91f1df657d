"""The side-by-side benchmark scripts still run: each with --dry-cpu (tiny shapes on the CPU) in a
subprocess, and fastweight's own rows must be measured, not n/a. (A NameError in a shared helper once
turned every fastweight row of bench_decode.py into n/a; only a GPU run would have shown it.) Peers
that are not installed here show as n/a: their rows are not checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["bench_deltanet.py", "bench_mlstm.py", "bench_decode.py"]


def table_rows(out: str):
    """The markdown table's data rows: lists of the cells between the pipes."""
    rows = []
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows  # without the header


def run_dry(script: str, out: Path, timeout: int, *args: str) -> subprocess.CompletedProcess:
    """bench/<script> --dry-cpu [args] in a subprocess that imports what this process imports (fastweight)."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(REPO / "bench" / script), "--dry-cpu", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_dry_cpu(script, tmp_path):
    pytest.importorskip("torch")
    r = run_dry(script, tmp_path, 600)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    ours = [row for row in table_rows(r.stdout) if len(row) > 1 and row[1].startswith("fastweight")]
    assert ours, f"{script}: no fastweight rows in its table:\n{r.stdout[-3000:]}"
    for row in ours:
        assert not row[2].startswith("n/a"), f"{script}: fastweight row not measured: {row}"
        float(row[2])  # a time


def test_bench_norms_dry_cpu(tmp_path):
    """bench_norms.py (its own table format, torch.compile included): the dry run completes and writes
    its CSV and JSON."""
    pytest.importorskip("torch")
    r = run_dry("bench_norms.py", tmp_path, 900)
    assert r.returncode == 0, f"bench_norms.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "[done]" in r.stdout + r.stderr
    assert (tmp_path / "bench_norms.json").exists() and (tmp_path / "bench_norms.csv").exists()


def test_bench_norms_extra_shapes(tmp_path):
    """--extra-shapes adds MxN rows to layernorm and rmsnorm (not to adaLN), which --shapes then keeps."""
    pytest.importorskip("torch")
    r = run_dry("bench_norms.py", tmp_path, 300, "--ops", "layernorm,rmsnorm,adalayernorm", "--no-compile",
                "--no-overhead", "--extra-shapes", "24x200", "--shapes", "24x200")
    assert r.returncode == 0, f"bench_norms.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    csv = (tmp_path / "bench_norms.csv").read_text()
    for op in ("layernorm", "rmsnorm"):
        assert any(line.startswith(op) and "24x200" in line for line in csv.splitlines()), f"no {op} 24x200 row:\n{csv}"
    assert "adalayernorm" not in csv
    bad = run_dry("bench_norms.py", tmp_path, 120, "--ops", "layernorm", "--extra-shapes", "24x")
    assert bad.returncode != 0 and "--extra-shapes" in bad.stdout + bad.stderr

