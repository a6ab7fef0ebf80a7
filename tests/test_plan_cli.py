"""``python -m partita plan``: the report's numbers are the Plan's, and bad input is a typed
error with the fix."""

from __future__ import annotations

import json

import pytest

from partita.cli import build_parser, main
from partita.cli.plan import lower_step, parse_bytes, parse_mesh, plan_all
from partita.cost import PROFILES
from partita.errors import ArgumentError, MeshError
from partita.models.llama_shapes import MODEL_PRESETS, load_shape
from partita.values.mesh import Mesh

SMALL = ["--model", "gpt-s", "--mesh", "2x2", "--device", "cpu", "--batch", "8", "--seq", "32"]


def _args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["plan", *argv])


def test_the_json_report_holds_the_plans_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SMALL, "--hardware", "cpu-gloo", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    plan = lower_step(load_shape("gpt-s"), Mesh.create((2, 2), ("data", "model")), "fsdp+tp",
                      8, 32, device="cpu")  # fmt: skip
    b = plan.memory_breakdown()
    assert r["memory"]["peak"] == b.peak == plan.memory().peak
    assert r["memory"]["at_peak"] == dict(b.at_peak)
    assert r["memory"]["limit"] == PROFILES["cpu-gloo"].memory
    assert r["memory"]["fits"] is True
    est = plan.estimate("cpu-gloo", overlap=False)  # the table says "no overlap"
    assert r["step"]["seconds"] == pytest.approx(est.total)
    assert r["step"]["flops"] == est.flops
    # bytes per axis add up to the Plan's bytes; their times to the estimate's communication
    assert sum(a["bytes"] for a in r["axes"].values()) == plan.bytes_per_device
    assert sum(a["seconds"] for a in r["axes"].values()) == pytest.approx(est.communication)
    assert set(r["axes"]) == {"data", "model"}
    assert r["mesh"] == {"data": 2, "model": 2} and r["devices"] == 4


def test_the_table_says_whether_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SMALL, "--hbm", "1MB"]) == 1  # 1 MB is too little
    out = capsys.readouterr().out
    assert "does not fit by" in out
    assert "bytes per mesh axis" in out and "estimated step time" in out
    assert main(["plan", *SMALL, "--shard", "dp", "--checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "fits (" in out and "activation checkpointing" in out


def test_a_head_count_the_model_axis_does_not_divide() -> None:
    with pytest.raises(ArgumentError, match=r"64 attention heads, which the 'model' axis of "
                       r"size 128 does not divide.*--mesh 128x8"):  # fmt: skip
        plan_all(_args("--model", "llama-3-70b", "--mesh", "8x128", "--shard", "fsdp+tp"))
    with pytest.raises(ArgumentError, match=r"8 key/value heads, which the 'model' axis of size "
                       r"16 does not divide"):  # fmt: skip
        plan_all(_args("--model", "llama-3-8b", "--mesh", "4x16"))


def test_no_preset_meets_the_memory_limit() -> None:
    with pytest.raises(ArgumentError, match=r"no preset fits 1.00 kB per device: the smallest "
                       r"peak is --shard \S+ at .*--checkpointing"):  # fmt: skip
        plan_all(_args(*SMALL, "--shard", "all", "--hbm", "1kB"))


def test_unknown_names_and_bad_strings() -> None:
    with pytest.raises(ArgumentError, match=r"unknown model preset 'llama-4'.*llama-3-8b, "
                       r"llama-3-70b, llama-3-405b"):  # fmt: skip
        plan_all(_args("--model", "llama-4"))
    with pytest.raises(MeshError, match=r"--mesh '8by128': expected positive sizes joined by"):
        parse_mesh("8by128")
    with pytest.raises(MeshError, match=r"--axes 'data' names 1 axes for a 2-D mesh"):
        plan_all(_args("--mesh", "2x2", "--axes", "data"))
    with pytest.raises(ArgumentError, match=r"--hbm '80 gigs'"):
        parse_bytes("80 gigs")
    with pytest.raises(ArgumentError, match=r"--shard 'zero3': the presets are dp, fsdp, tp"):
        plan_all(_args(*SMALL, "--shard", "zero3"))
    with pytest.raises(ArgumentError, match=r"unknown hardware profile 'tpu-v5'"):
        plan_all(_args(*SMALL, "--hardware", "tpu-v5"))


def test_an_error_is_printed_with_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--mesh", "8x128"]) == 2
    err = capsys.readouterr().err
    assert "ArgumentError" in err and "--mesh 128x8" in err


def test_a_transformers_config_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = load_shape(str(path))
    assert (shape.layers, shape.d_model, shape.kv_heads, shape.vocab) == (2, 64, 2, 256)
    r = plan_all(_args("--model", str(path), "--mesh", "2x2", "--device", "cpu", "--batch",
                       "4", "--seq", "16"))  # fmt: skip
    assert r[0]["model"]["name"] == "config" and r[0]["memory"]["fits"]
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ArgumentError, match=r"lacks \['num_hidden_layers'"):
        load_shape(str(tmp_path / "bad.json"))


def test_presets_have_the_published_shapes() -> None:
    s = MODEL_PRESETS["llama-3-70b"]
    assert (s.layers, s.d_model, s.d_ff, s.heads, s.kv_heads, s.vocab) == (
        80, 8192, 28672, 64, 8, 128256,
    )  # fmt: skip
    s = MODEL_PRESETS["llama-3-405b"]
    assert (s.layers, s.d_model, s.d_ff, s.heads, s.kv_heads) == (126, 16384, 53248, 128, 8)


def test_all_plans_the_presets_the_mesh_has_axes_for() -> None:
    reports = plan_all(_args("--model", "gpt-s", "--mesh", "4", "--device", "cpu", "--batch",
                             "8", "--seq", "32", "--shard", "all"))  # fmt: skip
    assert [r["shard"] for r in reports] == ["dp", "fsdp"]  # no 'model' axis: no tp presets
    dp, fsdp = (r["memory"] for r in reports)
    assert fsdp["parameters"] < dp["parameters"]  # fsdp splits them over 'data'


def test_axis_times_add_up_when_calls_behind_others_wait_less(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    spaced = dataclasses.replace(PROFILES["cpu-gloo"], call_overhead=2e-3, call_window=5e-3)
    monkeypatch.setitem(PROFILES, "cpu-gloo", spaced)
    assert main(["plan", *SMALL, "--hardware", "cpu-gloo", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    plan = lower_step(load_shape("gpt-s"), Mesh.create((2, 2), ("data", "model")), "fsdp+tp",
                      8, 32, device="cpu")  # fmt: skip
    est = plan.estimate(spaced, overlap=False)
    assert sum(est.spared.values()) > 0  # some calls follow others closely
    assert sum(a["seconds"] for a in r["axes"].values()) == pytest.approx(est.communication)
