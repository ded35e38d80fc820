"""The tuning table and meta= never crash, hang or lose data: bad entries are warned about and ignored,
thread counts are bounded by the machine, concurrent writers serialise, unwritable paths fail early."""

import json
import os
import textwrap
import warnings

import pytest
import torch

import bsrkit
from bsrkit import reference, tuning
from bsrkit.cli import main
from helpers import assert_close, finish_python, random_bsr, start_python

SHAPE, BLOCKS = (32, 32, 8), (8, 8)


def _write_entry(path, params_json):
    key = tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32, SHAPE, BLOCKS)
    header = '{"format": "bsrkit-tuning", "version": 1, "entries": '
    path.write_text(header + "{" + json.dumps(key) + ": " + params_json + "}}")
    return key


@pytest.mark.parametrize(
    "params_json",
    ['{"panel": "abc"}', '{"panel": null}', '{"panel": [1]}', '{"panel": NaN}', '{"nthreads": Infinity}',
     '{"panel": 0}', '{"panel": -1}', '{"nthreads": 1.5}', '{"panel": true}'],
)  # fmt: skip
def test_bad_entries_are_named_and_ignored(tmp_path, monkeypatch, params_json):
    table = tmp_path / "t.json"
    key = _write_entry(table, params_json)
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setattr(tuning, "_warned", set())
    bsr = random_bsr(SHAPE[:2], BLOCKS, 0.5)
    x = torch.randn(SHAPE[1], SHAPE[2])
    with pytest.warns(tuning.TuningWarning, match="ignoring entry") as record:
        got = bsrkit.bsr_dense_mm(bsr, x)
    message = str(record[0].message)
    assert key in message and str(table) in message
    assert record[0].filename == __file__  # the user's line, not bsrkit's
    assert_close(got, reference.bsr_dense_mm(bsr, x), k=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.TuningWarning)
        bsrkit.bsr_dense_mm(bsr, x)  # warned once


def test_deeply_nested_table_is_reported_not_a_recursion_error(tmp_path, monkeypatch):
    table = tmp_path / "deep.json"
    table.write_text("[" * 200_000 + "]" * 200_000)
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setattr(tuning, "_warned", set())
    with pytest.warns(tuning.TuningWarning, match="nested too deeply"):
        params = tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, SHAPE, BLOCKS, None)
    assert params["panel"] == SHAPE[2]


@pytest.mark.parametrize("nthreads", [2**31, 10**8])
def test_thread_counts_are_bounded_by_the_machine(tmp_path, monkeypatch, nthreads):
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((64, 64), (8, 8), 0.5)
    x = torch.randn(64, 64)
    got = bsrkit.bsr_dense_mm(bsr, x, meta={"nthreads": nthreads})  # would hang or take seconds
    assert_close(got, reference.bsr_dense_mm(bsr, x), k=64)
    params = tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, (64, 64, 64), (8, 8), {"nthreads": nthreads})
    assert params["nthreads"] <= (os.cpu_count() or 1)
    table = tmp_path / "t.json"
    _write_entry(table, json.dumps({"nthreads": nthreads}))
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    assert tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, SHAPE, BLOCKS, None)["nthreads"] <= (
        os.cpu_count() or 1
    )


def test_a_tuned_thread_count_stays_within_torchs(tmp_path, monkeypatch):
    """torch.set_num_threads(1) (the user's limit, and a one-thread benchmark's) holds over a table entry
    tuned with two threads; an explicit meta count is taken as asked."""
    table = tmp_path / "t.json"
    _write_entry(table, json.dumps({"nthreads": 2}))
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, SHAPE, BLOCKS, None)["nthreads"] == 1
        given = tuning.cpu_mm_meta("bsr_dense_mm", torch.float32, SHAPE, BLOCKS, {"nthreads": 2})
        assert given["nthreads"] == min(2, os.cpu_count() or 1)
    finally:
        torch.set_num_threads(threads)


_WRITER = textwrap.dedent(
    """
    import sys
    from bsrkit import tuning
    path, who = sys.argv[1], sys.argv[2]
    for i in range(40):
        tuning.save_entries({f"{who}|{i}": {"panel": 64}}, tuning.Path(path))
    """
)


def test_concurrent_writers_lose_nothing(tmp_path):
    table = tmp_path / "t.json"
    procs = [start_python(["-c", _WRITER, table, f"w{w}"]) for w in range(4)]
    for p in procs:
        finish_python(p, timeout=120)
    entries = json.loads(table.read_text())["entries"]
    assert len(entries) == 160
    assert not list(tmp_path.glob(".tuning-*"))


def test_unwritable_table_fails_before_tuning(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    timed = []
    monkeypatch.setattr("bsrkit.tune_command._tune_shape", lambda *a: timed.append(a))
    argv = ["tune", "--sizes", "64", "--blocksizes", "16", "--table", str(blocker / "t.json")]
    assert main(argv) == 2
    assert "cannot write the tuning table" in capsys.readouterr().err
    assert not timed  # no tuning work was done


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    table = tmp_path / "t.json"

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tuning.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        tuning.save_entries({"k": {"panel": 64}}, table)
    assert not list(tmp_path.glob(".tuning-*"))
    assert not table.exists()


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty shipped-tables folder in place of bsrkit/tuned/, and an empty user table."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    monkeypatch.setattr(tuning, "_SHIPPED_DIR", folder)
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "user.json"))
    tuning.shipped_entries.cache_clear()
    yield folder
    tuning.shipped_entries.cache_clear()


def _table(path, entries):
    path.write_text(json.dumps({"format": "bsrkit-tuning", "version": 1, "entries": entries}))


def test_lookup_order_user_exact_then_shipped_exact_then_shipped_class(shipped, tmp_path):
    device, bs = "cuda:Some GPU", (32, 32)
    mine, theirs = (256, 512, 1024), (512, 512, 1024)
    user_key = tuning.table_key(device, "bsr_dense_mm", torch.bfloat16, mine, bs)
    exact = tuning.table_key(device, "bsr_dense_mm", torch.bfloat16, theirs, bs)
    wide = tuning.class_key(device, "bsr_dense_mm", torch.bfloat16, 1024, bs)
    narrow = tuning.class_key(device, "bsr_dense_mm", torch.bfloat16, 16, bs)
    assert wide != narrow and tuning.shape_class(64) != tuning.shape_class(65)
    shipped_entries = {user_key: {"BLOCK_N": 32}, exact: {"BLOCK_N": 32}, wide: {"BLOCK_N": 64}}
    _table(shipped / "gpu.json", {**shipped_entries, narrow: {"BLOCK_N": 16}})
    _table(tmp_path / "user.json", {user_key: {"BLOCK_N": 128}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.TuningWarning)  # a hit in either table warns nothing
        assert tuning.lookup("bsr_dense_mm", torch.bfloat16, mine, bs, device) == {"BLOCK_N": 128}
        assert tuning.lookup("bsr_dense_mm", torch.bfloat16, theirs, bs, device) == {"BLOCK_N": 32}
        other = (128, 128, 2048)  # another M, K and a wide N: the class entry
        assert tuning.lookup("bsr_dense_mm", torch.bfloat16, other, bs, device) == {"BLOCK_N": 64}
        assert tuning.lookup("bsr_dense_mm", torch.bfloat16, (128, 128, 8), bs, device) == {"BLOCK_N": 16}
    # another dtype or blocksize has no entry: the defaults (after the one-time warning)
    assert tuning.lookup("bsr_dense_mm", torch.float16, mine, bs, device) is None
    assert tuning.lookup("bsr_dense_mm", torch.bfloat16, mine, (64, 64), device) is None


def test_shipped_tables_are_valid_for_their_backend():
    """Every entry of every table in bsrkit/tuned/ parses, names a known device kind, and passes the
    Triton backend's parameter schema (so no shipped entry is ever ignored with a warning)."""
    from bsrkit.backends import BACKENDS

    tuning.shipped_entries.cache_clear()
    entries = tuning.shipped_entries()
    assert entries, "no shipped table"
    schema = BACKENDS["triton"].param_schema
    for key, params in entries.items():
        device, op, dtype, shape, bs = key.split("|")
        assert (
            device.startswith("cuda:")
            and op == "bsr_dense_mm"
            and dtype in ("bfloat16", "float16", "float32")
        )
        assert shape in ("*,*,N<=64", "*,*,N>64") and bs in ("32x32", "64x64", "128x128")
        assert set(params) == set(schema), key
        assert all(schema[k].check(v) for k, v in params.items()), key


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
@pytest.mark.parametrize("source", ["meta", "table", "default"])
def test_a_chosen_thread_count_runs_below_the_serial_cut_off(tmp_path, monkeypatch, source):
    """Small products run on the calling thread by default, but a thread count from ``meta`` or the
    tuning table is kept (``bsrkit tune`` times each candidate count at its shape: it must run it)."""
    from bsrkit.backends.cpu import backend as cpu_backend
    from bsrkit.backends.cpu import running

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setattr(tuning, "_warned", {"fallback"})
    seen = []
    real_run, real_prepared = cpu_backend._run, running.prepared

    def spy_run(kernel, nthreads, *args):
        seen.append(nthreads)
        return real_run(kernel, nthreads, *args)

    def spy_prepared(kernel, full_args, *args):
        seen.append(full_args.nthreads)
        return real_prepared(kernel, full_args, *args)

    monkeypatch.setattr(cpu_backend, "_run", spy_run)
    monkeypatch.setattr(running, "prepared", spy_prepared)
    g = torch.Generator().manual_seed(3)
    bsr = random_bsr((32, 32), (8, 8), 0.5, generator=g)  # far below the cut-off
    meta = {"nthreads": 2} if source == "meta" else None
    table = tmp_path / "t.json"
    entries = {
        tuning.table_key(tuning.cpu_device_name(), name, torch.float32, shape, BLOCKS): {"nthreads": 2}
        for name, shape in [
            ("bsr_dense_mm", (32, 32, 1)),
            ("bsr_dense_mm", (32, 32, 40)),
            ("sampled_addmm", (32, 40, 32)),
        ]
    }
    table.write_text(json.dumps({"format": "bsrkit-tuning", "version": 1, "entries": entries}))
    if source == "table":
        monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    else:
        monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "none.json"))
    for N in (1, 40):  # the vector loops, then the gemm loop
        x = torch.randn((32, N), generator=g)
        assert_close(bsrkit.bsr_dense_mm(bsr, x, meta=meta), reference.bsr_dense_mm(bsr, x), k=32)
    a, b = torch.randn((32, 40), generator=g), torch.randn((40, 32), generator=g)
    got = bsrkit.sampled_addmm(bsr, a, b)  # (no meta: the table's count, else the default's)
    assert_close(got.to_dense(), reference.sampled_addmm(bsr, a, b).to_dense(), k=40)
    chosen = 1 if source == "default" else 2
    assert seen == [chosen, chosen, 2 if source == "table" else 1]


def test_a_table_reached_through_a_link_is_updated_where_it_lives(tmp_path):
    real = tmp_path / "real.json"
    tuning.save_entries({"old": {"panel": 8}}, real)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert set(tuning.load_table(link)) == {"old"}  # (read, so cached under the link's name)
    tuning.save_entries({"new": {"panel": 16}}, link)
    assert link.is_symlink() and set(json.loads(real.read_text())["entries"]) == {"old", "new"}
    # (this process sees its own write at once, through the link too: the cache held the old table)
    assert set(tuning.load_table(link)) == {"old", "new"}
