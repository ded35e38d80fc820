import functools
import json
import os
import sys
import warnings

import pytest
import torch

import bsrkit
from bsrkit import tuning
from bsrkit.cli import main
from helpers import random_bsr, run_python


def test_demo_runs_and_checks_its_result(capsys):
    bsrkit.cache_clear()  # (the count it prints is the process's: other tests' live tensors hold entries)
    assert main(["demo", "--size", "128", "--blocksize", "16", "--density", "0.3", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "OK" in text
    assert "plan cache: hits=" in text
    assert "after `del bsr`: entries=0" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--size", "100", "--blocksize", "16"],
        ["demo", "--density", "-1"],
        ["nope"],
        ["bench", "--ops", "sampled,nope"],
        ["bench", "--ops", "mm,foo"],
        ["bench", "--sizes", "100", "--blocksizes", "16"],
        ["bench", "--densities", "2"],
        ["tune", "--panels", "0"],
        ["tune", "--shapes", "64x64"],
        ["tune", "--shapes", "64x60x8", "--blocksizes", "16"],
        ["tune", "--blocksizes", "0x4"],
        ["tune", "--repeats", "0"],
        ["tune", "--shapes", ","],
        ["tune", "--blocksizes", ""],
        ["bench", "--repeats", "-3"],
        ["demo", "--density", "nan"],
        ["bench", "--densities", "nan"],
        ["bench", "--sizes", "64", "--blocksizes", "16", "--json", "/nonexistent-dir/x.json"],
        ["tune", "--sizes", "64", "--shapes", "96x96x8"],  # (--sizes was ignored)
        ["demo", "--hidden", "128"],  # (ignored without --model: the 2048² demo ran)
        ["tune", "--threads", "100000"],  # (stored as a tuned thread count)
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bsrkit") and "error:" in err
    assert len(err.splitlines()) == 1
    if argv[0] in ("demo", "bench", "tune"):  # (the subcommand's errors name it, after parsing too)
        assert err.startswith(f"bsrkit {argv[0]}: error:"), err


def test_bench_plot_without_matplotlib_is_refused_before_the_grid(tmp_path, monkeypatch, capsys):
    """It failed with ModuleNotFoundError after the whole grid had run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib: ImportError)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--sizes", "64", "--blocksizes", "16", "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert "--plot needs matplotlib: pip install 'bsrkit[plot]'" in out.err and out.out == ""


def test_help_for_each_command(capsys):
    for cmd in ("demo", "bench", "tune"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert "usage: bsrkit " + cmd in capsys.readouterr().out


def test_bench_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--sizes", "64", "--blocksizes", "16,32", "--densities", "0.25,0.5"]
    argv += ["--ops", "mm,addmm,sampled", "--repeats", "1", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    data = json.loads(out_json.read_text())
    assert data["schema"] == "bsrkit-bench/1" and data["complete"] is True
    assert len(data["results"]) == 12
    keys = {"op", "n", "blocksize", "density", "dtype", "bsrkit_s", "native_s", "dense_s", "x_native"}
    for row in data["results"]:
        assert keys <= row.keys()
        assert row["bsrkit_s"] > 0 and row["x_native"] == pytest.approx(row["native_s"] / row["bsrkit_s"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "x native" in table and "addmm" in table


def test_bench_ctrl_c_prints_what_finished(monkeypatch, capsys):
    import bsrkit.benchmarking as b

    real = b.run_point
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(b, "run_point", flaky)
    code = main(["bench", "--sizes", "64", "--blocksizes", "16", "--densities", "0.25,0.5", "--repeats", "1"])
    assert code == 130
    captured = capsys.readouterr()
    assert "interrupted: 1 of 2" in captured.err
    assert captured.out.count("float32") == 1  # the finished row


def test_tune_writes_a_table_that_products_use(tmp_path, monkeypatch):
    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    assert main(["tune", "--sizes", "64", "--blocksizes", "16", "--panels", "48", "--threads", "1"]) == 0
    data = json.loads(table.read_text())
    assert data["format"] == "bsrkit-tuning" and data["version"] == 1
    # (the transposed product takes the parameters untimed: no seconds of its own are recorded)
    timed = {
        name for key, entry in data["entries"].items() if "seconds" in entry for name in [key.split("|")[1]]
    }
    assert timed == {"bsr_dense_mm"} and len(data["entries"]) == 2
    params = tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, (64, 64, 64), (16, 16), None)
    assert params == {"panel": 48, "nthreads": 1}
    # Products run with the tuned parameters (and stay correct).
    seen = []
    real = tuning.resolve  # what every product calls for its parameters
    monkeypatch.setattr(tuning, "resolve", lambda *a: seen.append(real(*a)) or seen[-1])
    bsr = random_bsr((64, 64), (16, 16), 0.5)
    x = torch.randn(64, 64)
    torch.testing.assert_close(bsrkit.bsr_dense_mm(bsr, x), bsr.to_dense() @ x)
    assert seen == [{"panel": 48, "nthreads": 1}]


def test_tune_streamed_times_copies_that_span_the_cache_and_records_it(tmp_path, monkeypatch, capsys):
    from bsrkit import benchmarking, tune_command

    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "t.json"))
    monkeypatch.setattr(benchmarking, "last_level_cache_bytes", lambda: 64 << 10)  # 4x: 256 KiB
    seen = []
    real = tune_command._tune_shape
    monkeypatch.setattr(
        tune_command, "_tune_shape", lambda bsrs, *a: seen.append(list(bsrs)) or real(bsrs, *a)
    )
    argv = ["tune", "--shapes", "128x128x1", "--blocksizes", "16", "--density", "0.5", "--streamed"]
    assert main([*argv, "--panels", "64,128,256", "--threads", "1,2"]) == 0
    (bsrs,) = seen
    one = sum(t.numel() * t.element_size() for t in (bsrs[0].values(), bsrs[0].col_indices()))
    assert len(bsrs) > 1 and len(bsrs) * one >= 256 << 10 > (len(bsrs) - 1) * (one + 8 * 9)
    addresses = {t.data_ptr() for b in bsrs for t in (b.values(), b.crow_indices(), b.col_indices())}
    assert len(addresses) == 3 * len(bsrs)  # (each copy is its own memory)
    for b in bsrs[1:]:
        torch.testing.assert_close(b.to_dense(), bsrs[0].to_dense(), rtol=0, atol=0)
    entry = tuning.load_table()[tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32,
                                                 (128, 128, 1), (16, 16))]  # fmt: skip
    assert entry["streamed"] is True and entry["panel"] == 1  # (panels clamp to N = 1: one candidate each)
    assert "best panel=1 nthreads=" in capsys.readouterr().out
    # Without --streamed: one weight, recorded as such.
    seen.clear()
    assert main([*argv[:-1], "--panels", "64", "--threads", "1"]) == 0
    assert len(seen[0]) == 1
    assert tuning.load_table()[next(iter(tuning.load_table()))]["streamed"] is False


def test_tune_candidates_clamp_panels_to_the_columns():
    from bsrkit import tune_command

    args = tune_command.argparse.Namespace(backend="cpu", threads=[1, 2], panels=[64, 128, 256])
    assert tune_command._candidates(args, 1, 32) == [{"panel": 1, "nthreads": 1}, {"panel": 1, "nthreads": 2}]
    assert len(tune_command._candidates(args, 512, 32)) == 6


def test_tune_rectangular_shape_is_found_by_the_product(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "t.json"))
    argv = ["tune", "--shapes", "48x32x24", "--blocksizes", "8x16", "--panels", "16", "--threads", "1"]
    assert main(argv) == 0
    assert tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, (48, 32, 24), (8, 16), None) == {
        "panel": 16,
        "nthreads": 1,
    }


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"format": "other", "version": 1}',
        '{"format": "bsrkit-tuning", "version": 99, "entries": {}}',
        "[1, 2]",
    ],
)
def test_corrupt_or_foreign_table_is_reported_and_ignored(tmp_path, monkeypatch, content):
    table = tmp_path / "bad.json"
    table.write_text(content)
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setattr(tuning, "_warned", set())
    with pytest.warns(tuning.TuningWarning, match="ignoring tuning table"):
        params = tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, (64, 64, 64), (16, 16), None)
    assert params["panel"] == 64  # the default, clipped to N
    tune = ["tune", "--sizes", "64", "--blocksizes", "16", "--panels", "32", "--threads", "1"]
    if "bsrkit-tuning" in content:  # tune replaces a table of another version
        assert main(tune) == 0
        assert json.loads(table.read_text())["version"] == 1
    else:  # and never a file that is not a tuning table (a mistyped --table): it refuses, before tuning
        assert main(tune) == 2
        assert table.read_text() == content


def test_tune_keeps_a_tables_permissions_and_refuses_a_foreign_file(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("important user notes\n")
    tune = ["tune", "--sizes", "64", "--blocksizes", "16", "--panels", "32", "--threads", "1"]
    assert main([*tune, "--table", str(notes)]) == 2
    assert notes.read_text() == "important user notes\n"
    assert "is not a bsrkit tuning table" in capsys.readouterr().err
    table = tmp_path / "t.json"
    table.write_text("")  # empty: replaced
    table.chmod(0o640)
    assert main([*tune, "--table", str(table)]) == 0
    assert json.loads(table.read_text())["format"] == "bsrkit-tuning"
    assert table.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "fresh.json"
    assert main([*tune, "--table", str(fresh)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask  # open()'s permissions, not mkstemp's 0600


def test_tune_refuses_a_fifo_and_products_ignore_one(tmp_path):
    """A FIFO blocked the table's read for ever (and /dev/null, read as empty, was replaced by a JSON file
    when run as root): neither is a table, and a product reading one as $BSRKIT_TUNING_TABLE ignores it.
    In a child under a time limit: the old read never returned."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    script = (
        "import json, sys\n"
        "from bsrkit import tuning\n"
        "from bsrkit.cli import main\n"
        f"rc = main(['tune', '--sizes', '64', '--blocksizes', '16', '--panels', '32', '--threads', '1', "
        f"'--table', {str(fifo)!r}])\n"
        f"print(json.dumps([rc, tuning.load_table({str(fifo)!r})]))\n"
    )
    run = run_python(script, timeout=120)
    assert run.json() == [2, {}] and "is not a regular file" in run.stderr


def test_fallback_warning_once_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "missing.json"))
    monkeypatch.setattr(tuning, "_warned", set())
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    with pytest.warns(tuning.TuningWarning, match="bsrkit tune --shapes 32x32x16 --blocksizes 8x8"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(32, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.TuningWarning)
        bsrkit.bsr_dense_mm(bsr, torch.randn(32, 16))  # second time: silent


def test_table_written_by_another_process_is_seen_after_the_recheck_delay(tmp_path, monkeypatch):
    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    key = tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32, (64, 64, 64), (16, 16))

    def write(panel):  # as another process would: no call into this process's tuning module
        entries = {key: {"panel": panel}}
        table.write_text(json.dumps({"format": "bsrkit-tuning", "version": 1, "entries": entries}))

    write(16)
    meta = functools.partial(tuning.cpu_mm_meta, "bsr_dense_mm", torch.float32, (64, 64, 64), (16, 16), None)
    assert meta()["panel"] == 16
    write(32)
    os.utime(table, (1, 1))  # a distinct mtime even on coarse-clock file systems
    monkeypatch.setattr(tuning, "_RECHECK_SECONDS", 1e9)
    assert meta()["panel"] == 16  # within the delay: the file is not even stat-ed
    monkeypatch.setattr(tuning, "_RECHECK_SECONDS", 0.0)
    assert meta()["panel"] == 32


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"bsrkit {bsrkit.__version__}"


def test_demo_warns_nothing_and_says_where_its_parameters_come_from(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "empty.json"))
    monkeypatch.setattr(tuning, "_warned", set())  # as in a fresh process: the fallback warning not yet given
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning the demo lets through fails the test
        assert main(["demo", "--size", "64", "--blocksize", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel parameters: defaults (`bsrkit tune --shapes 64x64x64 --blocksizes 16` tunes them)" in out


def test_a_failing_command_prints_one_line(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(bsrkit, "bsr_dense_mm", broken)
    assert main(["demo", "--size", "64", "--blocksize", "16", "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert err == "bsrkit demo: error: RuntimeError: something broke\n"


def test_demo_model_compares_dense_and_sparsified_and_checks_logits(capsys):
    pytest.importorskip("transformers")
    argv = ["demo", "--model", "--hidden", "64", "--layers", "1", "--blocksize", "16", "--repeats", "1"]
    assert main([*argv, "--density", "0.5,0.25"]) == 0
    out = capsys.readouterr().out
    assert "dense (SDPA)" in out and "density 0.25 (7 layers)" in out and "density 0.5 (7 layers)" in out
    assert "max relative difference" in out and out.rstrip().endswith("OK")


@pytest.mark.parametrize("hidden", ["96", "0", "-64"])
def test_demo_model_rejects_a_hidden_size_it_cannot_split(capsys, hidden):
    with pytest.raises(SystemExit):
        main(["demo", "--model", "--hidden", hidden])
    assert "--hidden must be a positive multiple of 64" in capsys.readouterr().err


def test_bench_in_half_precision_marks_torchs_missing_kernel(capsys):
    """torch has no CPU kernel for a half-precision BSR product: its column says n/a (it failed the run)."""
    argv = ["bench", "--sizes", "64", "--blocksizes", "16", "--densities", "0.5", "--repeats", "1"]
    assert main([*argv, "--dtype", "float16"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert "float16" in row and row.count("n/a") == 3


def test_bench_writes_a_warning_on_a_line_of_its_own_and_a_density_in_its_column(
    tmp_path, monkeypatch, capsys
):
    """The TuningWarning was printed inside the progress bar's line; 0.0625 overflowed its column."""
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "missing.json"))
    monkeypatch.setattr(tuning, "_warned", set())
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always", tuning.TuningWarning)
        argv = ["bench", "--sizes", "64", "--blocksizes", "16", "--densities", "0.0625,0.5", "--repeats", "1"]
        assert main(argv) == 0
    assert warnings.showwarning is shown  # (put back)
    captured = capsys.readouterr()
    lines = [line.split("\r")[-1] for line in captured.err.splitlines()]
    assert any(line.startswith("TuningWarning: bsrkit: no tuned parameters") for line in lines), captured.err
    header, _, *rows = captured.out.strip().splitlines()[1:]
    bar = header.index("|")
    assert [row.index("|") for row in rows] == [bar, bar] and "0.0625 |" in rows[0], captured.out


def test_python_dash_m_bsrkit_is_the_command():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "bsrkit", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("bsrkit ")


@pytest.mark.parametrize(
    "extra",
    [
        ["--json", "{dir}"],  # a directory
        ["--plot", "{dir}/p.xyz"],  # a format matplotlib does not write
        ["--plot", "{dir}/plot"],  # no extension: matplotlib would write plot.png and we said plot
        ["--json", "{dir}/a.json", "--plot", "{dir}/a.json"],  # one file for both
    ],
)
def test_bench_refuses_an_output_it_cannot_write_before_timing(tmp_path, capsys, monkeypatch, extra):
    """Checked up front (they failed after the whole grid had run, or wrote another file than reported)."""
    import bsrkit.benchmarking

    monkeypatch.setattr(bsrkit.benchmarking, "run_point", lambda *a, **k: pytest.fail("timed a point"))
    argv = ["bench", "--sizes", "64", "--blocksizes", "16", "--densities", "0.25"]
    with pytest.raises(SystemExit) as exc:
        main(argv + [e.format(dir=tmp_path) for e in extra])
    assert exc.value.code == 2
    assert "error: --" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_demo_takes_one_value_per_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--size", "128,256", "--blocksize", "16"])
    assert exc.value.code == 2
    assert "--size takes one value in demo, got [128, 256]" in capsys.readouterr().err


def test_demo_on_one_thread_says_its_kernel_came_from_the_disk_cache():
    """On one thread the product runs the loop's serial twin: the demo read the parallel loop's counts and
    said "compiled" for a kernel loaded from the cache."""
    argv = ["-m", "bsrkit", "demo", "--size", "128", "--blocksize", "32", "--repeats", "1"]
    env = {"OMP_NUM_THREADS": "1"}
    run_python(argv, env=env, timeout=300)  # (compiles, or loads, the serial loop)
    out = run_python(argv, env=env, timeout=300).stdout
    assert "kernel loaded from the on-disk kernel cache" in out, out


def test_tune_times_a_weight_with_blocks_even_on_a_tiny_grid(tmp_path, monkeypatch):
    """A random draw at density 0.1 of one block stored none: tune timed an empty product."""
    from bsrkit import tune_command

    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "t.json"))
    seen = []
    real = tune_command._tune_shape
    monkeypatch.setattr(
        tune_command, "_tune_shape", lambda bsrs, *a: seen.append(bsrs[0]._nnz()) or real(bsrs, *a)
    )
    assert main(["tune", "--shapes", "16x16x1,64x64x4", "--blocksizes", "16", "--threads", "1"]) == 0
    assert seen == [1, 2]  # (at least one block; else 10% of 16, rounded)


@pytest.mark.parametrize("n, blocksize", [(8, 16), (40, 16), (16, 0)])
def test_random_bsr_weight_names_a_blocksize_that_does_not_divide_n(n, blocksize):
    """torch's shape mismatch escaped from inside it."""
    from bsrkit.benchmarking import random_bsr_weight

    with pytest.raises(
        ValueError, match=f"random_bsr_weight\\(\\): expected a blocksize >= 1 that divides n, got n == {n}"
    ):
        random_bsr_weight(n, blocksize, 0.5)
    bsr, dense = random_bsr_weight(32, 16, 0.5)
    assert bsr.shape == (32, 32) and bsr._nnz() == 2 and torch.equal(bsr.to_dense(), dense)


def test_one_malformed_entry_is_ignored_alone_and_tune_keeps_the_rest(tmp_path, monkeypatch):
    table = tmp_path / "t.json"
    key = tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32, (8, 8, 8), (4, 4))
    good = {"panel": 8, "nthreads": 1}
    table.write_text(json.dumps({"format": "bsrkit-tuning", "version": 1, "entries": {key: good, "bad": 3}}))
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setattr(tuning, "_warned", set())
    with pytest.warns(tuning.TuningWarning, match="ignoring 1 entries .* not parameter dicts"):
        assert tuning.load_table()[key] == good
    argv = ["tune", "--shapes", "16x16x16", "--blocksizes", "8", "--panels", "16", "--threads", "1"]
    assert main([*argv, "--repeats", "1"]) == 0
    assert json.loads(table.read_text())["entries"][key] == good


def test_tune_runs_the_backend_it_tunes_whatever_is_forced(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "t.json"))
    monkeypatch.setenv("BSRKIT_BACKEND", "torch")  # (no parameters: every candidate the same code)
    seen = []
    real = tuning.resolve
    monkeypatch.setattr(tuning, "resolve", lambda *a: seen.append(a) or real(*a))
    argv = ["tune", "--shapes", "16x16x16", "--blocksizes", "8", "--panels", "16", "--threads", "1"]
    assert main([*argv, "--repeats", "1"]) == 0
    assert seen and os.environ["BSRKIT_BACKEND"] == "torch"


def test_ctrl_c_during_tune_keeps_the_shapes_that_finished(tmp_path, monkeypatch, capsys):
    from bsrkit import tune_command

    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    real, calls = tune_command._tune_shape, []

    def interrupted_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(tune_command, "_tune_shape", interrupted_second)
    argv = ["tune", "--shapes", "8x8x8,16x16x16", "--blocksizes", "4", "--panels", "8", "--threads", "1"]
    assert main([*argv, "--repeats", "1"]) == 130
    assert len(json.loads(table.read_text())["entries"]) == 2  # (the first shape, both orientations)


@pytest.mark.parametrize("value", ["false", "off", "yes"])
def test_switch_variables_refuse_other_values_by_name(monkeypatch, value):
    monkeypatch.setenv("BSRKIT_FUSED_ATTENTION", value)
    mask = bsrkit.sliding_window_mask(32, 4, 8)
    q = torch.randn(32, 16)
    with pytest.raises(ValueError, match=r"\$BSRKIT_FUSED_ATTENTION in \('0', '1'\)"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask)


def test_a_bad_traceback_switch_is_an_argument_error(monkeypatch, capsys):
    # (read only once a command had failed, it raised inside the handler: a chained traceback)
    monkeypatch.setenv("BSRKIT_TRACEBACK", "yes")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--size", "64", "--blocksize", "16", "--repeats", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "$BSRKIT_TRACEBACK" in err[-1] and "error:" in err[-1]


def test_fallback_warning_names_the_dtype_and_only_ops_tune_can_tune(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "missing.json"))
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setattr(tuning, "_warned", set())
    bsr = random_bsr((32, 32), (8, 8), 0.5, dtype=torch.float64)
    with pytest.warns(tuning.TuningWarning, match="--blocksizes 8x8 --dtype float64`"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(32, 16, dtype=torch.float64))
    monkeypatch.setattr(tuning, "_warned", set())
    with pytest.warns(tuning.TuningWarning, match="bsrkit tune` tunes the products only"):
        bsrkit.sampled_addmm(
            bsr, torch.randn(32, 16, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
        )
