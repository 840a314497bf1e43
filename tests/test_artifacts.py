"""The typed contract between stages: kinds and choose(), JsonFile versions, staged() folders, CLI flag names."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hotneurons.artifacts.placement import Placement, PlacementMeta, PlacementSummary, read_placement
from hotneurons.artifacts.predictors import EvalMode, ModeResult
from hotneurons.artifacts.profile import ProfileMeta, read_profile
from hotneurons.common.artifacts import ArtifactError, read_json, staged, write_json
from hotneurons.common.kinds import Activation, Rule, choose
from hotneurons.solver.cli import main as solve_main
from hotneurons.solver.synthetic import llama_model_meta, synthetic_counts, write_profile


def test_kinds_print_and_serialise_as_their_values():
    assert f"{Activation.DRELU}" == str(Activation.DRELU) == "drelu" == Activation.DRELU
    assert json.dumps({"a": Activation.RELU, "r": Rule.ABS_TAU}) == '{"a": "relu", "r": "abs>tau"}'
    assert Rule.for_activation("reglu") is Rule.NONZERO and Rule.for_activation("swiglu") is Rule.ABS_TAU
    assert Activation.FATRELU.relu_family and not Activation.GEGLU.relu_family


def test_choose_one_line_listing_the_known_values():
    assert choose("relu", Activation, "activation") is Activation.RELU
    assert choose("fp16", {"fp16": 2, "bf16": 2}, "dtype") == "fp16"
    with pytest.raises(ValueError) as e:
        choose("silu", Activation, "activation", param="activation")
    assert str(e.value).startswith("unknown activation 'silu': choose one of relu, gelu, reglu")
    assert "\n" not in str(e.value) and e.value.params == ("activation",)
    with pytest.raises(KeyError):
        choose("x", ["a"], "thing", KeyError)


@pytest.fixture
def run(tmp_path):
    model = llama_model_meta("tiny", 2, 32, 128, 4, 2, 200)
    write_profile(tmp_path, model, synthetic_counts(2, 128, 1000, seed=1), 1000)
    return tmp_path


def test_profile_meta_round_trip_keeps_unknown_keys(run):
    path = run / "profile" / "meta.json"
    d = read_json(path)
    assert d["schema_version"] == 1 and d["rule"] == "nonzero"
    write_json(path, {**d, "note": "kept"})
    meta = ProfileMeta.load(path)
    assert meta.rule is Rule.NONZERO and meta.tokens == 1000 and meta["note"] == "kept" and "note" in meta
    meta.save(path)
    assert read_json(path)["note"] == "kept"


@pytest.mark.parametrize("change,needle", [
    ({"schema_version": 2}, "schema_version 2, this hotneurons reads 1: re-run pi-profile"),
    ({"format_version": 7}, "format_version 7"),
    ({"rule": "sometimes"}, "unknown rule 'sometimes'"),
    ({"stage": "placement"}, "a 'placement' artifact, expected 'profile'"),
])
def test_readers_refuse_other_versions_in_one_line(run, change, needle):
    path = run / "profile" / "meta.json"
    write_json(path, {**read_json(path), **change})
    with pytest.raises(ArtifactError, match=needle) as e:
        read_profile(run)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(solve_main, ["--run", str(run), "--vram", "24GB"])
    assert r.exit_code != 0 and needle in r.output and len(r.output.strip().splitlines()) == 1


def test_missing_required_key_names_file_and_fix(run):
    path = run / "profile" / "meta.json"
    d = read_json(path)
    del d["tokens"]
    write_json(path, d)
    with pytest.raises(ArtifactError, match="lacks 'tokens': re-run pi-profile"):
        read_profile(run)


def test_file_without_schema_version_reads_as_version_1(run):
    path = run / "profile" / "meta.json"
    d = read_json(path)
    del d["schema_version"]
    write_json(path, d)
    assert read_profile(run)[1].schema_version == 1


def test_placement_files_typed_and_read_placement(run):
    from hotneurons.common.hardware import get_hardware
    from hotneurons.solver import solve_placement

    pytest.importorskip("pulp")
    s = solve_placement(run, get_hardware("rtx4090"), vram_bytes=10**9, ctx=16, reserve_bytes=0)
    on_disk = PlacementSummary.load(run / "placement" / "summary.json")
    assert on_disk.to_dict() == json.loads(json.dumps(s.to_dict()))  # what is returned is what is written
    assert on_disk.flags.ctx == 16 and on_disk.solver.objective == "latency"
    assert PlacementMeta.load(run / "placement" / "meta.json").flags.objective == "latency"
    info = read_profile(run)[1].model
    p = read_placement(run, info)
    assert len(p) == 2 and [int(p[i].sum()) for i in range(2)] == [x.gpu_neurons for x in s.layers]
    # one Placement for every reader: numpy masks, the meta it was read with, the runtime's from_run the same
    assert all(isinstance(g, np.ndarray) and g.dtype == bool and g.shape == (info["n_neurons"],) for g in p.gpu)
    assert p.meta.flags.ctx == 16 and p.gpu_share() == pytest.approx(s.gpu_neuron_share)
    q = Placement.from_run(run, info)
    assert all(np.array_equal(a, b) for a, b in zip(p.gpu, q.gpu)) and len(q) == 2
    assert Placement.uniform(2, 5, True).gpu_share() == 1.0 and Placement.uniform(2, 5, False).meta is None
    summary = read_json(run / "placement" / "summary.json")
    write_json(run / "placement" / "summary.json", {**summary, "schema_version": 3})
    with pytest.raises(ArtifactError, match="summary.json has schema_version 3.*re-run pi-solve"):
        PlacementSummary.load(run / "placement" / "summary.json")
    with pytest.raises(ArtifactError, match="made for model"):
        read_placement(run, {**info, "fingerprint": "0" * 64, "name": "other"})


def test_optional_keys_are_left_out_while_none():
    r = ModeResult(perplexity=2.0, nll_per_token=0.7, tokens=3, ffn_sparsity=0.5, recall=1.0, magnitude_recall=1.0,
                   true_sparsity=0.5, per_layer={}, seconds=0.1)
    assert "ppl_vs_dense" not in r and "ppl_vs_dense" not in r.to_dict() and r.get("ppl_vs_dense", 9) == 9
    r.ppl_vs_dense = 0.01
    assert r["ppl_vs_dense"] == 0.01 and list(r.to_dict())[-1] == "ppl_vs_dense"
    assert EvalMode("oracle") is EvalMode.ORACLE


def test_staged_swaps_in_whole_or_not_at_all(tmp_path):
    final = tmp_path / "stage"
    with staged(final) as part:
        (part / "a.txt").write_text("1")
    assert (final / "a.txt").read_text() == "1" and not part.exists()
    with pytest.raises(RuntimeError):
        with staged(final) as part:
            (part / "a.txt").write_text("2")
            raise RuntimeError("boom")
    assert (final / "a.txt").read_text() == "1" and not part.exists()  # the old folder survives, no debris
    with pytest.raises(KeyboardInterrupt):
        with staged(final, keep_on_failure=lambda p: (p / "state.json").exists()) as part:
            (part / "state.json").write_text("{}")
            raise KeyboardInterrupt
    assert (part / "state.json").exists()  # kept for a resume
    with staged(final, fresh=False) as again:
        assert (again / "state.json").exists()
        np.save(again / "x.npy", np.zeros(2))
    assert sorted(p.name for p in final.iterdir()) == ["state.json", "x.npy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]
