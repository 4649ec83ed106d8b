"""The command line: ir, passes, ops; errors print a message, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diphoma_compile.cli import main
from diphoma_compile.ir import parse

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "mlp_sgd_step.ir")


def test_ir_runs_passes_and_prints_stats(capsys):
    assert main(["ir", EXAMPLE, "--passes", "dce,cse", "--stats"]) == 0
    out = capsys.readouterr().out
    g = parse(out)  # the stats are comments: the output still reads back
    assert g.passes == ("dce", "cse")
    assert "%unused" not in out and "%zero.1" not in out
    assert "# ops: 37 " in out and "# peak live memory per device:" in out
    assert "# pass dce: changed" in out and "# pass cse: changed" in out


def test_ir_dump_after_and_out_file(tmp_path, capsys):
    out_file = tmp_path / "o.ir"
    assert main(["ir", EXAMPLE, "--passes", "dce,cse", "--dump-ir-after", "dce",
                 "--out", str(out_file)]) == 0
    dumped = capsys.readouterr().out
    assert dumped.startswith("# IR after dce\n") and "passes[dce]" in dumped
    assert parse(out_file.read_text()).passes == ("dce", "cse")


def test_errors_are_messages_not_tracebacks(tmp_path, capsys):
    bad = tmp_path / "bad.ir"
    bad.write_text("graph @g () {\n  %a: f99[2] = full() {value=1}\n  return ()\n}\n")
    assert main(["ir", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "error: line 2" in err and "unknown dtype 'f99'" in err
    assert "Traceback" not in err
    assert main(["ir", EXAMPLE, "--passes", "dce,nope"]) == 2
    assert "unknown pass 'nope'" in capsys.readouterr().err
    assert main(["ir", str(tmp_path / "missing.ir")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no such file: {tmp_path / 'missing.ir'}\n  hint: ")
    assert "Errno" not in err
    assert main(["ir", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    # a pass that does not run was dumped after silently (inspect refused it)
    assert main(["ir", EXAMPLE, "--passes", "dce", "--dump-ir-after", "nopass"]) == 2
    assert "--dump-ir-after nopass: no pass of that name is in --passes (it has dce)" in \
        capsys.readouterr().err
    # a graph with no mesh: the hint says where a mesh comes from
    assert main(["ir", EXAMPLE, "--passes", "data-parallel{axis=dp}"]) == 2
    err = capsys.readouterr().err
    assert "a graph with no mesh runs on one device" in err and "mesh[dp=N]" in err


def test_list_passes_and_ops(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    names = [line.split("{")[0].split()[0] for line in out.splitlines() if line.strip()]
    assert names == sorted(names)
    for name in ("cse", "dce", "data-parallel", "weight-update-sharding", "comm-fusion",
                 "schedule-comm"):
        assert name in names
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "reduce_scatter" in out and "opaque" in out and "quantize" in out


def test_module_entry_point_reads_stdin():
    text = Path(EXAMPLE).read_text()
    r = subprocess.run([sys.executable, "-m", "diphoma_compile", "ir", "-", "--passes", "dce"],
                       input=text, capture_output=True, text=True, check=True)
    assert parse(r.stdout).passes == ("dce",)


def test_version(capsys):
    import diphoma_compile
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"diphoma {diphoma_compile.__version__}\n"


@pytest.mark.parametrize("command", [[], ["inspect"], ["ir"], ["passes"], ["ops"]])
def test_help_shows_no_rst_markup(capsys, command):
    """The descriptions come from docstrings, whose ``literals`` are RST: not in --help."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: diphoma")
    assert "``" not in out
    if not command:
        assert "python -m diphoma_compile or diphoma" in out
