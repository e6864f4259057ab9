"""`brigade serve` parallel flags and the `parallel` config section (no Ray started)."""
from __future__ import annotations

import pytest

from cluster import cli
from cluster.config import ClusterConfig


def _serve_config(*argv: str) -> ClusterConfig:
    return cli.cluster_config(cli.build_parser().parse_args(["serve", *argv]))


def test_parallel_flags_set_the_section_and_count_ranks():
    cfg = _serve_config("--prefill-tp", "2", "--decode-tp", "4", "--decode", "2")
    assert (cfg.parallel.prefill_tp, cfg.parallel.decode_tp, cfg.parallel.decode_ep) == (2, 4, 1)
    assert cfg.parallel.sizes("prefill") == (2, 1) and cfg.parallel.sizes("decode") == (4, 1)
    assert cfg.num_ranks == 1 * 2 + 2 * 4
    assert _serve_config("--decode-ep", "2").parallel.ranks("decode") == 2


@pytest.mark.parametrize(("argv", "expected"), [
    (["--decode-tp", "2", "--decode-ep", "4"], "decode_tp 2 and decode_ep 4"),
    (["--decode-tp", "0"], "--decode-tp: Input should be greater than or equal to 1"),
    (["--decode-tp", "3"], "--decode-tp: tp_size 3 must divide the model's 4 attention heads"),
    (["--prefill-tp", "8"], "--prefill-tp: tp_size 8 must divide the model's 4 attention heads"),
    (["--decode-ep", "2"], "--decode-ep: ep_size 2 needs an MoE model"),
])
def test_a_split_that_cannot_work_is_one_error_line_before_anything_starts(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--http-port", "0", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert expected in err, err
