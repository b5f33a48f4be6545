"""`reinforge bench kernels`: its help anywhere, one line and exit 2 without CUDA or on a bad argument, and the
sweeps' arithmetic (tiling grids, bytes and FLOPs, JSON rows) on the CPU."""

from __future__ import annotations

import pytest
import torch

from reinforge.bench import kernels
from reinforge.bench.kernels import decode_attention, decode_products, softcap_attention, timing, varlen_attention
from reinforge.cli import main

ARGUMENTS = {"decode-attention": ["--shape", "0.5b", "--fp8"], "decode-products": [],
             "rollout-kernels": ["--shape", "0.5b"], "softcap-attention": ["--tokens", "1280", "--segment", "640"],
             "varlen-attention": []}


def exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code


def test_help_lists_every_sweep_and_each_sweep_gives_its_options(capsys):
    assert main(["bench", "--help"]) == 0
    assert "  kernels" in capsys.readouterr().out
    assert exit_code(["bench", "kernels", "--help"]) == 0
    out = capsys.readouterr().out
    assert set(ARGUMENTS) == set(kernels.SWEEPS) and all(which in out for which in ARGUMENTS)
    for which, flags in ARGUMENTS.items():
        assert exit_code(["bench", "kernels", which, "--help"]) == 0
        out = capsys.readouterr().out
        assert "OUT.json" in out and all(flag in out for flag in flags if flag.startswith("--"))


@pytest.fixture
def no_work(monkeypatch):
    """Every sweep's run recorded instead of run."""
    ran = []
    for module, _ in kernels.SWEEPS.values():
        monkeypatch.setattr(module, "run", ran.append)
    return ran


@pytest.mark.parametrize("which", list(ARGUMENTS))
def test_without_cuda_each_sweep_says_so_in_one_line_and_exits_2_before_any_work(which, tmp_path, monkeypatch,
                                                                                 no_work, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.json"
    assert main(["bench", "kernels", which, str(out), *ARGUMENTS[which]]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"reinforge bench kernels {which}: it times CUDA kernels") and "no CUDA device" in line
    assert no_work == [] and not out.exists()


def test_with_cuda_the_sweep_runs_with_its_parsed_flags(tmp_path, monkeypatch, no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "tilings.json"
    assert main(["bench", "kernels", "decode-attention", str(out), "--shape", "1.5b-long", "--candidates"]) == 0
    [args] = no_work
    assert (args.which, args.out, args.shape, args.fp8, args.candidates) == ("decode-attention", out, "1.5b-long",
                                                                            False, True)
    assert main(["bench", "kernels", "softcap-attention", str(out)]) == 0
    assert (no_work[1].tokens, no_work[1].segment) == (24576, 640)


@pytest.mark.parametrize(("argv", "says"), [
    ([], "required: WHICH"),
    (["decode-attentoin", "out.json"], "invalid choice: 'decode-attentoin'"),
    (["decode-products"], "required: OUT.json"),
    (["decode-attention", "out.json", "--shape", "2b"], "invalid choice: '2b'"),
    (["rollout-kernels", "out.json"], "required: --shape"),
    (["softcap-attention", "out.json", "--segment", "0"], "--segment: 0 is not a positive number of tokens"),
    (["softcap-attention", "out.json", "--tokens", "many"], "--tokens: invalid positive_int value: 'many'"),
    (["varlen-attention", "missing/out.json"], "its folder 'missing' does not exist"),
    (["varlen-attention", "."], "OUT.json '.' is a folder"),
])
def test_argument_errors_are_one_line_and_exit_2(argv, says, tmp_path, monkeypatch, no_work, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert exit_code(["bench", "kernels", *argv]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("reinforge bench kernels") and says in line and "--help" in line
    assert no_work == []


def test_decode_attention_tiling_grid_bytes_and_rows():
    short = decode_attention.tiling_grid(short=True, engine_splits=1)
    assert len(short) == 4 * 3 * 4 * 3 - 3 * 4 * 2  # split 128-token blocks left out
    assert all(options["block_n"] <= 64 for options in short if options["num_splits"] > 1)
    assert {options["min_chunk_tokens"] for options in short} == {64}
    long = decode_attention.tiling_grid(short=False, engine_splits=5)
    assert {options["num_splits"] for options in long} == {1, 5, 10} and len(long) == 3 * 2 * 2 * 3
    assert len(decode_attention.tiling_grid(short=False, engine_splits=1)) == 3 * 2 * 2 * 2  # 1 and 2 splits
    assert decode_attention.kv_bytes(8, 1024, 2, 128, fp8=False) == 2 * 8 * 1024 * 2 * 128 * 2
    assert decode_attention.kv_bytes(8, 1024, 2, 128, fp8=True) == 2 * 8 * 1024 * 2 * (128 + 4)
    row = decode_attention.tiling_row(long[0] | {"heads_first": True}, ms=0.5, read_bytes=10 ** 9)
    assert row == {"block_n": 32, "warps": 4, "stages": 2, "splits": 1, "heads_first": True, "elementwise": False,
                   "ms": 0.5, "tbps": 2.0}


def test_decode_products_split_k_is_the_product_and_every_k_splits_evenly():
    assert all(k % splits == 0 for _, k in decode_products.PRODUCTS.values() for splits in decode_products.SPLITS)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator).bfloat16()
    weight_kn = torch.randn(64, 24, generator=generator).bfloat16()
    expected = x.float() @ weight_kn.float()
    for splits in decode_products.SPLITS:
        got = decode_products.split_k(*decode_products.split_k_operands(x, weight_kn, splits))
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), expected, rtol=2e-2, atol=5e-2)
    assert decode_products.floor_us(2048, 1536) == pytest.approx(2048 * 1536 * 2 / 4.19e12 * 1e6)


def test_softcap_attention_candidates_segments_and_summary():
    forward, backward = softcap_attention.candidates()
    assert (len(forward), len(backward)) == (60, 40)  # the counts softcap_kernels' tables were picked from
    assert all(stages < 3 for *_, stages in backward)
    assert softcap_attention.segment_lengths(24576, 640) == [640] * 38 + [256]
    assert softcap_attention.segment_lengths(100, 640) == [100]
    summary = {"table": {}, "table_ms": {"forward": 1.0, "backward": 2.0},
               "results": {"forward": [{"blocks": [64, 32, 4, 2], "ms": 0.9, "relative_error": 0.0},
                                       {"blocks": [128, 32, 8, 3], "ms": None, "failed": "OutOfResources"}]}}
    assert softcap_attention.summary_lines(summary)[1] == \
        "forward: 1 timed, 1 failed or inexact; fastest: (64, 32, 4, 2) 0.900 ms"


def test_varlen_attention_flops_rows_and_failures():
    assert varlen_attention.causal_forward_flops(1, 2, 1, 1) == 4 * 3  # 2 queries see 1 and 2 keys
    assert varlen_attention.causal_forward_flops(5, 8320, 12, 128) == 4 * 5 * 8320 * 8321 / 2 * 12 * 128
    row = varlen_attention.kernel_row(forward_ms=1.0, both_ms=3.0, flops_forward=1e12, error=1e-3)
    assert row == {"forward_ms": 1.0, "backward_ms": 2.0, "forward_tflops": 1000.0, "backward_tflops": 1250.0,
                   "max_relative_error": 1e-3}
    assert timing.failure_text(RuntimeError()) == "RuntimeError: "  # a failure with no message still gives a line
    assert timing.failure_text(RuntimeError("no kernel\nfor sm_80")) == "RuntimeError: no kernel"
    line = varlen_attention.case_line({"case": "1.5b-640", "flash": row, "cudnn": {"error": "RuntimeError: x"},
                                       "cudnn_expanded": {"error": "RuntimeError: x"}})
    assert line.startswith("1.5b-640: flash fwd 1.00 ms (1000 TF/s) bwd 2.00 ms (1250 TF/s)")
    assert timing.relative_error([torch.ones(4), torch.zeros(2)], [torch.ones(4) * 2, torch.ones(2)]) == 1.0


def test_varlen_attention_runs_each_kernel_in_a_process_of_its_own(tmp_path, monkeypatch):
    """A kernel whose process dies (a device fault) loses its own row only; the JSON is written as each case ends."""
    import argparse
    import json
    import subprocess

    monkeypatch.setattr(varlen_attention.torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setattr(varlen_attention.torch.backends.cudnn, "version", lambda: 1)

    def fake_run(command, **kwargs):
        case, kernel = command[-2:]
        if kernel == "cudnn":
            return subprocess.CompletedProcess(command, 1, "", "Traceback ...\nAcceleratorError: illegal memory access\n")
        found = {kernel: 0.5} if case == "alignment" else {
            "forward_ms": 1.0, "backward_ms": 2.0, "forward_tflops": 1.0, "backward_tflops": 1.0,
            "max_relative_error": 0.0, "tokens": 640, "forward_tflop": 0.1}
        return subprocess.CompletedProcess(command, 0, varlen_attention.RESULT_MARK + json.dumps(found) + "\n", "")

    monkeypatch.setattr(varlen_attention.subprocess, "run", fake_run)
    out = tmp_path / "va.json"
    varlen_attention.run(argparse.Namespace(out=out, one=None))
    result = json.loads(out.read_text())
    assert [row["case"] for row in result["rows"]] == [case[0] for case in varlen_attention.CASES]
    first = result["rows"][0]
    assert first["flash"]["forward_ms"] == 1.0 and first["tokens"] == 640
    assert first["cudnn"] == {"error": "its process exited 1: AcceleratorError: illegal memory access"}
    assert result["alignment"] == {"flash": 0.5, "cudnn": "its process exited 1: AcceleratorError: illegal memory access"}
