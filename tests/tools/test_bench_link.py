"""`refit bench --link-rate`: the receivers in their own network namespace behind a rate-limited veth, the
floor a raw TCP send across it, our rows as ratios to it; the veth's counters show the bytes crossed, and the
namespaces are gone afterwards, also after a failure."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from refit.tools.bench import link as bench_link
from refit.tools.bench.link import Link, can_make_links, rate_bits
from refit.tools.cli import main
from refit.tools.doctor import nixl_installed


@pytest.mark.parametrize(
    ("rate", "bits"),
    [("1gbit", 10**9), ("10gbit", 10**10), ("500mbit", 5 * 10**8), ("2.5Gbit", 25 * 10**8), ("none", 0)],
)
def test_link_rates_read_as_tc_writes_them(rate: str, bits: int) -> None:
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1gbt", "fast", "gbit", "1bit"])
def test_a_rate_tc_would_not_take_is_one_line_before_anything_runs(rate: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--link-rate", rate, "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: link rate") and rate in err, err


def test_without_the_right_to_make_namespaces_the_bench_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(bench_link, "can_make_links", lambda: "needs root (CAP_NET_ADMIN) to make network namespaces")
    assert main(["bench", "--link-rate", "1gbit", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "needs root" in err and "drop --link-rate" in err, err


@pytest.mark.parametrize("transport", ["shm", "cuda-ipc"])
def test_a_transport_the_link_does_not_run_is_refused_in_one_line(
    transport: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["bench", "--link-rate", "1gbit", "--transport", transport, "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"not {transport}" in err, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sites", "2", "--receivers", "4"], "give --link-rate too"),
        (["--sites", "2", "--receivers", "2,3", "--link-rate", "1gbit"], "does not divide --receivers 3"),
    ],
)
def test_sites_without_a_link_or_dividing_no_receiver_count_is_one_line(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(bench_link, "can_make_links", lambda: "")
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def root() -> None:
    why = can_make_links()
    if why:
        pytest.skip(why)


@pytest.mark.slow
def test_a_link_is_removed_when_its_block_fails(root: None) -> None:
    made = Link(rate="1gbit", tag="fails")
    with pytest.raises(RuntimeError, match="inside"), made:
        assert made.a in _namespaces()
        raise RuntimeError("inside")
    assert made.a not in _namespaces() and made.b not in _namespaces()


@pytest.mark.slow
def test_bench_across_a_1gbit_link_reports_the_floor_and_our_rows_and_the_bytes_crossed(
    root: None, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--link-rate", "1gbit", "--preset", "tiny", "--repeats", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "floor: raw TCP send of the model's bytes across the veth (1gbit)" in text
    assert "delta refit + fingerprint after an AdamW step" in text and "% of link rate" in text
    (report,) = json.loads(out.read_text())
    res = report["results"]
    assert report["link"] == {"rate": "1gbit", "rate_bits": 10**9}
    assert set(res) == {"floor", "refit", "fingerprint", "step_full", "step_delta"}
    for name, r in res.items():  # every byte each method put on the data plane crossed the veth
        assert r["link_bytes"] >= r["wire_bytes"] > 0, (name, r["link_bytes"], r["wire_bytes"])
        assert r["ratio_to_floor"] > 0
    assert 0.5 < res["floor"]["link_fraction"] <= 1.05, res["floor"]["link_fraction"]
    assert res["step_delta"]["delta_refits"] == 3 and res["step_full"]["delta_refits"] == 0
    assert res["step_delta"]["wire_bytes"] < res["step_full"]["wire_bytes"] / 2
    assert f"refit-la-{os.getpid()} " not in _namespaces() + " ", "the bench left its namespaces behind"


@pytest.mark.slow
def test_two_sites_of_two_over_relay_take_one_copy_into_each_site_and_two_across_the_trainers_veth(
    root: None, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    """Each site behind its own veth: relay sends each bucket once per site, so the trainer's veth carries the
    model twice and each site's veth once (its relay passes it on inside the site); every replica verified."""
    out, repeats = tmp_path / "bench.json", 2
    argv = ["bench", "--link-rate", "1gbit", "--preset", "tiny", "--transport", "relay", "--receivers", "4"]
    argv += ["--sites", "2", "--methods", "floor,refit,fingerprint", "--repeats", str(repeats), "--warmup", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "MB into each site" in capsys.readouterr().out
    (report,) = json.loads(out.read_text())
    assert report["link"] == {"rate": "1gbit", "rate_bits": 10**9, "sites": 2}
    model = report["nbytes"] * (1 + repeats)  # the warmup refit crosses too
    for name in ("refit", "fingerprint"):
        r = report["results"][name]
        assert 2 * model <= r["link_bytes"] <= 2.1 * model + (1 << 20), (name, r["link_bytes"], model)
        for k, into in enumerate(r["site_bytes"]):
            assert model <= into <= 1.05 * model + (1 << 20), (name, k, into, model)
        assert r["link_bytes"] >= r["wire_bytes"] > 0
    assert report["results"]["fingerprint"]["ratio_to_floor"] > 0
    assert f"refit-ls0-{os.getpid()} " not in _namespaces() + " ", "the bench left its namespaces behind"


@pytest.mark.slow
def test_bench_runs_nixl_across_the_link_on_tcp_and_every_byte_crosses_the_veth(
    root: None, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    """nixl's UCX would read through cross-memory attach between two namespaces of one kernel: kept to TCP,
    every READ crosses the veth."""
    if not nixl_installed():
        pytest.skip("needs nixl: pip install '.[nixl]'")
    out = tmp_path / "bench.json"
    argv = ["bench", "--link-rate", "1gbit", "--transport", "nixl", "--preset", "tiny", "--methods", "floor,refit"]
    assert main([*argv, "--repeats", "3", "--json", str(out)]) == 0
    (report,) = json.loads(out.read_text())
    r = report["results"]["refit"]
    assert r["link_bytes"] >= r["wire_bytes"] > 0, (r["link_bytes"], r["wire_bytes"])
    assert r["ratio_to_floor"] < 2.0


def test_the_link_plot_draws_time_against_the_rate_per_transport_and_method(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from refit.tools.bench.report import plot

    def report(transport: str, rate: str, bits: int, ms: float) -> dict:
        results = {m: {"median_s": ms * k / 1e3} for m, k in (("floor", 1.0), ("refit", 1.1), ("step_delta", 0.4))}
        link = {"rate": rate, "rate_bits": bits}
        return {"config": {"preset": "moe-small", "transport": transport}, "link": link, "results": results}

    reports = [report(t, r, b, 8e12 / b) for t in ("gloo", "nixl") for r, b in (("1gbit", 10**9), ("10gbit", 10**10))]
    out = tmp_path / "curve.png"
    plot(reports, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
