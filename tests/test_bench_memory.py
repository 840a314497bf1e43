"""The memory benchmark (bench/memory*.py): the /proc sampler, the streamed model writers, the results record."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import memory, memory_models, memory_probe


def test_sampler_measures_a_known_allocation():
    # 200 MB of bytearray held for 0.5 s, text on stdout once it is allocated
    code = ("import time; b = bytearray(200 * 10**6); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); "
            "time.sleep(0.5)")
    base = memory_probe.measure([sys.executable, "-c", "import time; time.sleep(0.5)"])
    m = memory_probe.measure([sys.executable, "-c", code], first_output=r"read(y)")
    assert m.exit_code == 0 and not m.timed_out and m.samples >= 10
    assert m.peak_anon_bytes - base.peak_anon_bytes == pytest.approx(200e6, rel=0.15)
    assert m.peak_rss_bytes == pytest.approx(m.peak_anon_bytes + m.peak_file_bytes, rel=0.05)
    assert m.hwm_bytes == pytest.approx(m.peak_rss_bytes, rel=0.15)
    assert m.first_match == "y" and 0 < m.first_output_s < m.wall_s and m.stdout_tail == "ready\n"
    assert m.timeline and json.loads(json.dumps(m.to_dict()))["peak_rss_bytes"] == m.peak_rss_bytes


def test_sampler_sums_the_process_tree_and_stops_at_the_timeout():
    child = "import time; b = bytearray(100 * 10**6); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.8)"
    code = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {child!r}])"
    m = memory_probe.measure([sys.executable, "-c", code])
    alone = memory_probe.measure([sys.executable, "-c", child])
    assert m.exit_code == 0 and m.peak_anon_bytes > alone.peak_anon_bytes  # the parent's own pages on top
    assert m.peak_anon_bytes >= 100e6
    slow = memory_probe.measure([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert slow.timed_out and slow.exit_code is None and slow.wall_s < 10


def test_snapshot_and_a_match_on_stderr():
    # pi-serve's way: its URL on stderr once it listens, then it runs until stopped
    code = ("import sys, time; print('log', flush=True); sys.stderr.write('at http://x:1/v1, ready'); "
            "sys.stderr.flush(); time.sleep(30)")
    with memory_probe.Monitor([sys.executable, "-c", code], first_output=r"(https?://\S+?)/v1",
                              first_output_on=("stdout", "stderr")) as mon:
        assert mon.wait_for_output(20) == "http://x:1"
        u = mon.snapshot("after_1")
        m = mon.stop()
    assert u.rss > 0 and m.snapshots["after_1"]["rss"] == u.rss and m.exit_code != 0 and m.first_output_s > 0
    assert m.stderr_tail == "at http://x:1/v1, ready" and m.stdout_tail == "log\n" and m.wall_s < 20
    # a command that ends without the text: the wait ends with it
    with memory_probe.Monitor([sys.executable, "-c", "print('no url')"], first_output="http") as mon:
        assert mon.wait_for_output(20) is None
        assert mon.wait(20).first_output_s is None


def test_preset_sizes():
    assert memory_models.SHAPES["1.7GB"].bf16_bytes == pytest.approx(1.67e9, rel=0.02)
    assert memory_models.SHAPES["3.1GB"].bf16_bytes == pytest.approx(3.08e9, rel=0.02)
    assert memory_models.SHAPES["small"].bf16_bytes < 8e6


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory-models")
    return folder, memory_models.ensure_models("small", folder, log=lambda _: None)


def test_safetensors_folder_loads(small_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, files = small_models
    s = memory_models.SHAPES["small"]
    lm = AutoModelForCausalLM.from_pretrained(files["hf"]["model"])
    tok = AutoTokenizer.from_pretrained(files["hf"]["model"])
    assert lm.config.hidden_act == "relu" and lm.dtype == torch.bfloat16 and not lm.config.tie_word_embeddings
    assert lm.model.embed_tokens.weight.shape == (s.vocab, s.d_model)
    assert lm.model.layers[1].mlp.gate_proj.weight.shape == (s.n_neurons, s.d_model)
    assert lm.model.layers[1].self_attn.k_proj.weight.shape == (s.n_kv_heads * s.head_dim, s.d_model)
    up = lm.model.layers[0].mlp.up_proj.weight.detach().float()
    assert float(up.std()) == pytest.approx(memory_models.STD, rel=0.1)
    ids = tok("hello", return_tensors="pt").input_ids
    assert lm(ids).logits.shape == (1, ids.shape[1], s.vocab)
    assert tok.decode([s.vocab - 1]) == f"t{s.vocab - 1}"  # every id the model can emit decodes to text
    assert files["hf"]["file_bytes"] == pytest.approx(s.bf16_bytes, rel=0.01)


def test_gguf_is_q4_0_with_the_activation_and_the_same_weights(small_models):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    _, files = small_models
    s = memory_models.SHAPES["small"]
    r = gguf.GGUFReader(files["gguf"]["file"])
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert len(types) == 3 + 9 * s.n_layers
    assert types["blk.0.ffn_gate.weight"] == types["token_embd.weight"] == types["blk.1.attn_q.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert r.fields[memory_models.ACTIVATION_KEY].contents() == "reglu"
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0
    # transformers undoes llama.cpp's Q/K permutation: its q_proj is the safetensors' within Q4_0's rounding
    gguf_path = Path(files["gguf"]["file"])
    gg = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf = AutoModelForCausalLM.from_pretrained(files["hf"]["model"])
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        a = hf.model.layers[1].get_submodule(name).weight.detach().float()
        b = gg.model.layers[1].get_submodule(name).weight.detach().float()
        assert float((a - b).abs().max()) < 0.2 * float(a.abs().max()), name
        assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.98, name


def test_models_are_reused_when_the_manifest_matches(small_models):
    folder, files = small_models
    logs = []
    again = memory_models.ensure_models("small", folder, log=logs.append)
    assert again == files and logs == []


def test_results_record_and_markdown(tmp_path, monkeypatch):
    # a bench run with stub stages: each command is a tiny python process
    s = memory.Settings(shapes=("small",), formats=("gguf",), stages=("generate-bf16", "solve", "generate-q4"),
                        requests=2)
    monkeypatch.setitem(memory.STAGES, "generate-bf16", memory.Stage(
        ("python", "-c", "print('t1 t2', flush=True); import sys; sys.exit(0)"), first_output=r"(?s)."))
    monkeypatch.setitem(memory.STAGES, "generate-q4", memory.Stage(
        ("python", "-c", "print('--cold-dtype [bf16|int8]')"), needs="q4_0"))
    monkeypatch.setattr(memory, "tool", lambda name: sys.executable if name == "python" else name)
    figures = memory.run_bench(s, tmp_path / "models", tmp_path / "runs", log=lambda _: None)
    out, rec = memory.write(figures, tmp_path / "r.json", kind="cpu", command="pi-bench --stage memory")
    back = json.loads(out.read_text())
    assert back["figures"]["settings"]["shapes"] == ["small"] and back["machine"]["nproc"] >= 1
    gen, solve, q4 = back["figures"]["rows"]
    assert gen["status"] == "ok" and gen["exit_code"] == 0 and gen["first_token_s"] > 0
    for k in ("file_bytes", "peak_rss_bytes", "peak_anon_bytes", "peak_file_bytes", "ratio_to_file", "wall_s",
              "command", "stderr_tail"):
        assert k in gen, k
    assert gen["ratio_to_file"] == pytest.approx(gen["peak_rss_bytes"] / gen["file_bytes"], rel=1e-2)
    assert solve["status"] == "skipped" and "no GPU budget" in solve["reason"]  # no profile in that run
    assert q4["status"] == "skipped" and "q4_0" in q4["reason"]
    md = out.with_suffix(".md").read_text()
    assert "| small | gguf |" in md and "skipped" in md and md.count("\n| small") == 3
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1  # every row has the header's columns
    assert back["figures"]["floor"]["peak_rss_bytes"] > 0 and "ratio_above_floor" in gen


def test_stage_table_fills_every_placeholder(tmp_path):
    vals = memory.values(memory.PRESETS["small"], "m", tmp_path, tmp_path / "c.txt") | {"vram": "1GB"}
    for name, st in memory.STAGES.items():
        argv = [a.format(**vals) for a in st.argv]
        assert not any("{" in a for a in argv), name


def test_pi_bench_hands_the_memory_stage_its_own_flags():
    from bench.pi_bench import _memory_argv

    assert _memory_argv(["--stage", "memory", "--preset", "small"]) == ["--preset", "small"]
    assert _memory_argv(["--out", "x", "--stage=memory"]) == ["--out", "x"]
    assert _memory_argv(["--stage", "bench", "--device", "cpu"]) is None


def _gpu_peak(tmp_path, monkeypatch, script: str, want: int, **kw) -> int:
    """GpuMemory's peak over a process under a stand-in nvidia-smi (`script`, a shell script: $PID_UNDER_TEST is the
    measured process), once it reaches `want` MiB or after 5 s."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(6)"])
    monkeypatch.setenv("PID_UNDER_TEST", str(proc.pid))
    try:
        with memory_probe.GpuMemory(proc.pid, **kw) as g:
            deadline = time.time() + 5
            while g.peak < want << 20 and time.time() < deadline:
                time.sleep(0.05)
        return g.peak
    finally:
        proc.kill()
        proc.wait()


def test_gpu_memory_reads_one_looping_nvidia_smi(tmp_path, monkeypatch):
    # the loop's blocks for the measured process (two lines: its figure rising) and another process's, not counted
    script = ("echo \"$PID_UNDER_TEST, 100\"; echo '1, 9999'; echo 'No running processes found'\n"
              "echo \"$PID_UNDER_TEST, 300\"; exec sleep 30\n")
    assert _gpu_peak(tmp_path, monkeypatch, script, 300, interval=0.05) == 300 << 20  # MiB -> bytes


def test_gpu_memory_falls_back_to_a_call_a_second_without_loop_mode(tmp_path, monkeypatch):
    # an nvidia-smi that refuses --loop-ms (exits at once) and answers single queries
    script = "case \"$*\" in *loop*) exit 2;; esac\necho \"$PID_UNDER_TEST, 200\"\n"
    assert _gpu_peak(tmp_path, monkeypatch, script, 200) == 200 << 20


def test_gpu_memory_falls_back_when_the_loop_gives_no_line(tmp_path, monkeypatch):
    # a looping nvidia-smi whose output never comes (held in a buffer): after first_line_s, single calls
    script = "case \"$*\" in *loop*) exec sleep 30;; esac\necho \"$PID_UNDER_TEST, 300\"\n"
    assert _gpu_peak(tmp_path, monkeypatch, script, 300, first_line_s=0.3) == 300 << 20
