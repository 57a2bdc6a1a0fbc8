"""launch/ds_compat.py's own logic, without a DeepSpeed checkout: the config injection, the
stock-vs-zen classification and report, and the usage errors (unit suite: nothing is started)."""
from __future__ import annotations

import base64
import json
import os
import sys

import pytest

LAUNCH = os.path.join(os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")), "launch")
sys.path.insert(0, LAUNCH)
import ds_compat  # noqa: E402
import ds_compat_hook as hook  # noqa: E402

ZEN = hook.ZEN_BLOCKS["zen"]
TOPK = hook.ZEN_BLOCKS["zen-topk"]


# ----------------------------------------------------------------------------- injection
def test_inject_dict_adds_block_without_touching_the_callers_dict():
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam"}}
    out = hook.inject(config, TOPK)
    assert out["zen"] == {"enabled": True,
                          "compression": {"type": "topk", "density": 0.01, "min_numel": 1}}
    assert out["optimizer"] == {"type": "Adam"}
    assert "zen" not in config
    out["zen"]["compression"]["density"] = 0.5  # a deep copy: the mode's block is unchanged
    assert TOPK["compression"]["density"] == 0.01


def test_inject_keeps_an_existing_zen_block_and_stock_mode_changes_nothing():
    config = {"train_batch_size": 2, "zen": {"enabled": False}}
    assert hook.inject(config, ZEN) is config
    assert hook.inject({"a": 1}, hook.ZEN_BLOCKS["stock"]) == {"a": 1}
    assert hook.inject(None, ZEN) is None


@pytest.mark.parametrize("text", ['{"train_batch_size": 4}', '{\n  train_batch_size: 4\n}'],
                         ids=["json", "hjson"])
def test_inject_path_writes_a_new_json_file(tmp_path, text):
    pytest.importorskip("hjson")
    src = tmp_path / "ds_config.json"
    src.write_text(text)
    out = hook.inject(str(src), ZEN, workdir=str(tmp_path))
    assert isinstance(out, str) and out != str(src)
    assert json.loads((tmp_path / os.path.basename(out)).read_text()) == {
        "train_batch_size": 4, "zen": {"enabled": True}}
    assert src.read_text() == text  # the test's own file is left alone


def test_inject_base64_and_unknown_inputs():
    raw = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 1}).encode()).decode()
    out = hook.inject(raw, ZEN)
    assert json.loads(base64.urlsafe_b64decode(out)) == {"train_batch_size": 1, "zen": {"enabled": True}}
    assert hook.inject("/no/such/file.json", ZEN) == "/no/such/file.json"
    sentinel = object()
    assert hook.inject(sentinel, ZEN) is sentinel


def test_port_drops_removed_keys_in_every_form(tmp_path):
    config = {"train_batch_size": 2, "sparse_gradients": True}
    assert hook.port(config) == {"train_batch_size": 2}
    assert config["sparse_gradients"] is True
    clean = {"train_batch_size": 2}
    assert hook.port(clean) is clean
    src = tmp_path / "c.json"
    src.write_text(json.dumps(config))
    out = hook.port(str(src), workdir=str(tmp_path))
    assert json.loads((tmp_path / os.path.basename(out)).read_text()) == {"train_batch_size": 2}
    both = hook.inject(hook.port(config), ZEN)
    assert both == {"train_batch_size": 2, "zen": {"enabled": True}}


def test_port_engine_adds_only_a_missing_attribute():
    import types

    class Engine:
        pass

    class OldEngine:
        sparse_tensor_module_names = {"emb"}

    for cls, expected in ((Engine, frozenset()), (OldEngine, {"emb"})):
        ds = types.SimpleNamespace(runtime=types.SimpleNamespace(engine=types.SimpleNamespace(DeepSpeedEngine=cls)))
        hook._port_engine(ds)
        assert cls.sparse_tensor_module_names == expected


def test_error_line_is_type_and_first_line():
    from zen_ds import ZenConfigError
    assert hook.error_line(ZenConfigError("zen: no\nmore")) == "ZenConfigError: zen: no"
    assert hook.error_line(AssertionError()) == "AssertionError:"


# ----------------------------------------------------------------------------- classification
def rec(outcome, error="", initialize_errors=()):
    return {"outcome": outcome, "error": error, "initialize_errors": list(initialize_errors),
            "duration": 1.0, "wall": 1.0, "skip": ""}


@pytest.mark.parametrize("stock,zen,expected", [
    (rec("passed"), rec("passed"), "same"),
    (rec("skipped"), rec("skipped"), "same"),
    (rec("passed"), rec("failed", "ZenConfigError: zen: sparse gradients need ZeRO-0"), "refused"),
    (rec("passed"), rec("failed", "ValueError: zen checkpoint was saved for params"), "zen-only failure"),
    (rec("passed"), rec("failed", "ZenConfigError: invalid block"), "zen-only failure"),
    (rec("passed"), rec("timeout", "no result within 300 s"), "zen-only failure"),
    (rec("passed"), rec("failed", "Failed: Worker 0 exited with code 1",
                        ["ZenConfigError: zen: refused"]), "refused"),
    (rec("failed", "AssertionError: x"), rec("passed"), "zen-only pass"),
    (rec("failed", "AssertionError: x"), rec("failed", "AssertionError: x"), "same"),
    (rec("failed", "AssertionError: x"), rec("error", "ValueError: y"), "fails differently"),
    (rec("passed"), rec("skipped"), "skip differs"),
    (rec("passed"), rec("skipped", initialize_errors=["ZenConfigError: zen: no"]), "refused"),
    (None, rec("passed"), "not run"),
])
def test_classify(stock, zen, expected):
    assert ds_compat.classify(stock, zen) == expected
    assert expected in ds_compat.CATEGORIES


def fake_report():
    a, b, c = "unit/a.py::T::test", "unit/b.py::T::test[1]", "unit/c.py::test_x"
    results = {
        "stock": {"seconds": 60, "tests": {a: rec("passed"), b: rec("passed"), c: rec("failed", "E: stock")}},
        "zen": {"seconds": 60, "tests": {a: rec("passed"), b: rec("failed", "ZenConfigError: zen: no"),
                                         c: rec("failed", "E: stock")}},
        "zen-topk": {"seconds": 60, "tests": {a: rec("failed", "ValueError: optimizer got an empty parameter list"),
                                              b: rec("passed"), c: rec("failed", "E: stock")}},
    }
    return {"deepspeed_commit": "abc", "deepspeed_checkout_version": "0.19.6",
            "deepspeed_version": "0.19.8", "zen_ds_commit": "def", "tests": [a, b, c],
            "results": results, "diff": ds_compat.compare(results)}


def test_compare_and_markdown_flag_zen_only_failures():
    report = fake_report()
    assert report["diff"]["zen"] == {"unit/a.py::T::test": "same", "unit/b.py::T::test[1]": "refused",
                                     "unit/c.py::test_x": "same"}
    assert report["diff"]["zen-topk"]["unit/a.py::T::test"] == "zen-only failure"
    text = ds_compat.markdown(report)
    assert "| zen | 1 | 2 | 0 | 0 | 0 | 1 | 0 | 0 | 0 | ? |" in text
    assert "| zen-topk | 1 | 2 | 0 | 0 | 0 | 0 | 0 | 1 | 0 | ? |" in text
    assert "| `unit/a.py::T::test` | passed | passed | **failed** ⚠ |" in text
    assert "| `unit/b.py::T::test[1]` | passed | refused | passed |" in text
    assert "[zen-topk, zen-only failure]: `ValueError: optimizer got an empty parameter list`" in text
    assert "- `unit/c.py::test_x`: `E: stock`" in text  # failing stock: listed apart


def test_compression_loss_counts_only_where_plain_zen_passes_and_a_value_assertion_fails():
    a, b, c, d = "unit/a.py::t", "unit/b.py::t", "unit/c.py::t", "unit/d.py::t"
    results = {
        "stock": {"seconds": 60, "tests": {t: rec("passed") for t in (a, b, c, d)}},
        "zen": {"seconds": 60, "tests": {a: rec("passed"), b: rec("passed"), c: rec("passed"),
                                         d: rec("failed", "AssertionError: zen")}},
        "zen-topk": {"seconds": 60, "tests": {
            a: rec("failed", "AssertionError: step 1 != expected"),      # compression's loss
            b: rec("failed", "RuntimeError: crashed"),                   # not a value check
            c: rec("timeout", "no result within 300 s"),                 # a hang
            d: rec("failed", "AssertionError: step 1 != expected")}},    # fails uncompressed too
    }
    diff = ds_compat.compare(results)
    assert diff["zen-topk"] == {a: "lossy by design", b: "zen-only failure", c: "zen-only failure",
                                d: "zen-only failure"}
    # without the plain zen mode nothing can be called compression's loss
    assert ds_compat.compare({m: results[m] for m in ("stock", "zen-topk")})["zen-topk"][a] == \
        "zen-only failure"
    report = {"deepspeed_commit": "abc", "deepspeed_checkout_version": "0.19.6",
              "deepspeed_version": "0.19.8", "zen_ds_commit": "def", "tests": [a, b, c, d],
              "results": results, "diff": diff}
    assert "| `unit/a.py::t` | passed | passed | failed (lossy by design) |" in ds_compat.markdown(report)


def test_baseline_reuses_every_mode_not_run_again(tmp_path):
    earlier = {"deepspeed_commit": "abc", "results": {
        "stock": {"tests": {}}, "zen": {"tests": {}}, "zen-topk": {"tests": {}}}}
    path = tmp_path / "ds_compat.json"
    path.write_text(json.dumps(earlier))
    checkout = ds_compat.Checkout(root=tmp_path, tests=tmp_path, commit="abc", version="0.19.6")
    kept = ds_compat.load_baseline(str(path), checkout, ["zen-topk"])
    assert list(kept) == ["stock", "zen"] and kept["zen"]["baseline"] == str(path)
    with pytest.raises(ds_compat.UsageError, match="ran DeepSpeed's tests at abc"):
        ds_compat.load_baseline(str(path), ds_compat.Checkout(root=tmp_path, tests=tmp_path, commit="xyz",
                                                              version="0.19.6"), ["zen"])
    # a results file without the stock baseline, or not a results file at all: a usage error
    path.write_text(json.dumps({"deepspeed_commit": "abc", "results": {"zen": {"tests": {}}}}))
    with pytest.raises(ds_compat.UsageError, match="no stock results"):
        ds_compat.load_baseline(str(path), checkout, ["zen-topk"])
    path.write_text("[1, 2]")
    with pytest.raises(ds_compat.UsageError, match="not a results file"):
        ds_compat.load_baseline(str(path), checkout, ["zen-topk"])


def test_attached_counts_tests_where_zen_synced_a_param():
    tests = {"a": dict(rec("passed"), zen_attached=[{"route": "shared", "params": 2}] * 2),
             "b": dict(rec("passed"), zen_attached=[None, None]),
             "c": dict(rec("failed"), zen_attached=[])}
    assert ds_compat.attached(tests) == "1 of 3"
    assert ds_compat.attached({"a": rec("passed")}) == "?"  # records from before the field existed


# ----------------------------------------------------------------------------- usage errors
def test_missing_checkout_exits_2_with_a_clear_message(tmp_path, capsys):
    assert ds_compat.main(["--checkout", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeed checkout not found" in err and "nope" in err


def test_checkout_without_tests_and_no_checkout_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "ds").mkdir()
    assert ds_compat.main(["--checkout", str(tmp_path / "ds"), "--out", str(tmp_path)]) == 2
    assert "missing tests/unit/common.py" in capsys.readouterr().err
    monkeypatch.delenv("DS_CHECKOUT", raising=False)
    assert ds_compat.main(["--out", str(tmp_path)]) == 2
    assert "pass --checkout" in capsys.readouterr().err


def test_unknown_mode_exits_2(tmp_path, capsys):
    root = tmp_path / "ds"
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "unit" / "common.py").write_text("")
    (root / "tests" / "conftest.py").write_text("")
    assert ds_compat.main(["--checkout", str(root), "--modes", "stock,zen-fast", "--out", str(tmp_path)]) == 2
    assert "zen-fast" in capsys.readouterr().err


def test_default_list_is_a_fixed_set_of_node_ids(capsys):
    assert 60 <= len(ds_compat.ENGINE_TESTS) <= 80 and 40 <= len(ds_compat.FEATURE_TESTS) <= 80
    assert ds_compat.DEFAULT_TESTS == ds_compat.ENGINE_TESTS + ds_compat.FEATURE_TESTS
    assert len(set(ds_compat.DEFAULT_TESTS)) == len(ds_compat.DEFAULT_TESTS)
    assert all(t.startswith("unit/") and "::" in t for t in ds_compat.DEFAULT_TESTS)
    assert ds_compat.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == list(ds_compat.DEFAULT_TESTS)
    assert ds_compat.main(["--list", "--features"]) == 0
    assert capsys.readouterr().out.split() == list(ds_compat.FEATURE_TESTS)
